//! egressd's audit line, compiled: what `egressd.audit.line` does in Python, byte for byte.
//!
//! `Head(fallback)(record)` is `line.head(record)`: the record's JSON text (as
//! `json.dumps(record, separators=(",", ":"), ensure_ascii=True, allow_nan=False)`
//! writes it) without its closing brace and with a comma after its last field.
//! It takes what the audit log holds (a plain dict of plain str keys whose values
//! are exactly str, int, float or None) and hands anything else to `fallback`, the
//! Python function, which writes it or raises as `json.dumps` does: a str that is
//! not valid UTF-8 (a lone surrogate), an int past 64 bits, a float that is not
//! finite, a bool, a nested value. Floats are written by Python's own `repr`, so
//! they cannot differ.
//!
//! `chain(heads, prev)` is the log's hash chain over a batch of heads: each line
//! is the head with `"prev":...}` and a newline, where `prev` is the SHA-256 (hex)
//! of the line before it; it returns the lines' bytes, joined, and the last hash.
//!
//! The Python module is the reference; tests/unit/audit/test_native_line.py feeds
//! both the same records.

use std::fmt::Write as _;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyFloat, PyInt, PyString};
use sha2::{Digest, Sha256};

/// What `egressd.audit.native` checks before it uses this module: a change of
/// meaning in `Head` or `chain` changes it, and a mismatched build is not used.
const INTERFACE: u32 = 1;

const HEX: &[u8; 16] = b"0123456789abcdef";

/// `s` as JSON writes a str with `ensure_ascii`, quotes included (json's `encode_basestring_ascii`).
fn push_string(out: &mut String, s: &str) {
    out.push('"');
    if s.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\') {
        out.push_str(s);
    } else {
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                ' '..='~' => out.push(c),
                _ => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{:04x}", unit);
                    }
                }
            }
        }
    }
    out.push('"');
}

/// The head of `record`, or None where the Python path must decide.
fn encode_head(record: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    if !record.is_exact_instance_of::<PyDict>() {
        return Ok(None);
    }
    let record = record.downcast::<PyDict>()?;
    let mut out = String::with_capacity(512);
    out.push('{');
    for (key, value) in record.iter() {
        if !key.is_exact_instance_of::<PyString>() {
            return Ok(None);
        }
        let Ok(key) = key.downcast::<PyString>()?.to_str() else {
            return Ok(None); // a lone surrogate: not UTF-8
        };
        push_string(&mut out, key);
        out.push(':');
        if value.is_none() {
            out.push_str("null");
        } else if value.is_exact_instance_of::<PyString>() {
            let Ok(text) = value.downcast::<PyString>()?.to_str() else {
                return Ok(None);
            };
            push_string(&mut out, text);
        } else if value.is_exact_instance_of::<PyInt>() {
            let Ok(number) = value.extract::<i64>() else {
                return Ok(None); // past 64 bits: Python writes it (or refuses it, past its digit limit)
            };
            let _ = write!(out, "{number}");
        } else if value.is_exact_instance_of::<PyFloat>() {
            if !value.extract::<f64>()?.is_finite() {
                return Ok(None); // allow_nan=False: Python raises ValueError
            }
            out.push_str(value.repr()?.to_str()?);
        } else {
            return Ok(None);
        }
        out.push(',');
    }
    // An empty record is "{"; any other ends with the comma `prev` is written after.
    Ok(Some(out))
}

/// `egressd.audit.line.head`, compiled; `fallback` (the Python function) takes what this does not.
#[pyclass(frozen, module = "egressd_native")]
struct Head {
    fallback: Py<PyAny>,
}

#[pymethods]
impl Head {
    #[new]
    fn new(fallback: Py<PyAny>) -> Self {
        Head { fallback }
    }

    fn __call__(&self, py: Python<'_>, record: &Bound<'_, PyAny>) -> PyResult<PyObject> {
        match encode_head(record)? {
            Some(text) => Ok(PyString::new(py, &text).into_any().unbind()),
            None => self.fallback.call1(py, (record,)),
        }
    }
}

/// The chained lines of `heads` after `prev`, joined, and the SHA-256 (hex) of the last one.
#[pyfunction]
#[pyo3(signature = (heads, prev))]
fn chain<'py>(
    py: Python<'py>,
    heads: Vec<Bound<'py, PyString>>,
    prev: Option<String>,
) -> PyResult<(Bound<'py, PyBytes>, Option<String>)> {
    let mut data: Vec<u8> = Vec::with_capacity(heads.len() * 600);
    let mut prev = prev;
    let mut digest = [0u8; 64];
    for head in &heads {
        let head = head.to_str()?;
        if !head.is_ascii() {
            return Err(PyValueError::new_err("an audit line's head must be ASCII"));
        }
        let start = data.len();
        data.extend_from_slice(head.as_bytes());
        match &prev {
            None => data.extend_from_slice(b"\"prev\":null}\n"),
            Some(hash) => {
                data.extend_from_slice(b"\"prev\":\"");
                data.extend_from_slice(hash.as_bytes());
                data.extend_from_slice(b"\"}\n");
            }
        }
        let hash = Sha256::digest(&data[start..]);
        for (i, byte) in hash.iter().enumerate() {
            digest[2 * i] = HEX[(byte >> 4) as usize];
            digest[2 * i + 1] = HEX[(byte & 15) as usize];
        }
        // ASCII hex digits: valid UTF-8 by construction.
        prev = Some(String::from_utf8(digest.to_vec()).expect("hex is ASCII"));
    }
    Ok((PyBytes::new(py, &data), prev))
}

#[pymodule]
fn egressd_native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add("INTERFACE", INTERFACE)?;
    module.add("__version__", env!("CARGO_PKG_VERSION"))?;
    module.add_class::<Head>()?;
    module.add_function(wrap_pyfunction!(chain, module)?)?;
    Ok(())
}
