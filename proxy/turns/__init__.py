"""One turn: its tenant, session, route, the local-backend seam, and its outcome and headers."""
