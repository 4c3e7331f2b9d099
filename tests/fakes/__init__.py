"""What the tests stand in for the world with: upstream DNS, Slack, a webhook receiver, model endpoints,
a TLS origin and its CA, ClientHello builders, and the Docker test bed. Each is real over sockets; none is a mock."""
