"""Free loopback ports for the integration tests that start daemons and servers themselves."""
import socket


def free_ports(n):
    """n distinct free loopback ports: every socket stays bound until all are chosen (ports taken
    one after another can come back equal once the first socket is closed: two daemons of one
    test then race for one metrics port)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
