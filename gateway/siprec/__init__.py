"""SIPREC (RFC 7866) recording sessions: multipart bodies, RFC 7865 metadata, and the call's legs."""
