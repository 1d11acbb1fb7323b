"""SIP (RFC 3261 subset, trunk mode): pure message/transaction/dialog/auth/admission cores and the
`UserAgent` core that composes them (`agent.py`), plus the asyncio UDP+TCP adapter (`endpoint.py`)."""
