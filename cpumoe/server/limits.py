"""What one server allows a client, and for how long: defaults shared by the server and `cpumoe serve`'s flags."""

MAX_REQUEST_BYTES = 8 << 20    # a prompt that fills a 128k context is a few hundred KB to ~1 MB of JSON
HEADER_TIMEOUT_S = 10.0        # from a connection's opening (or its last response) to a request's complete headers
IDLE_TIMEOUT_S = 5.0           # a kept-alive connection with no request
MAX_CONNECTIONS = 1000
SHUTDOWN_GRACE_S = 30.0        # how long requests in flight may still run after SIGTERM
