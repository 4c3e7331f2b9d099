"""Mutation fuzzing of the pure parsers: ``fuzz_parsers`` runs standalone, ``test_fuzz`` briefly under pytest."""
