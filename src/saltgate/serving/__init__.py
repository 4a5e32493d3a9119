"""How a gateway runs as processes: assembled and served alone (run.py), or as a
supervisor (supervisor.py) with workers (worker.py) that share one listening socket,
take its connections in turn (acceptor.py, balance.py) and take orders over a control
channel (control.py)."""
