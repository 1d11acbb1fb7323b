"""RTP receive side: packet parsing, sequence/timestamp unwrapping, jitter buffer, RFC 4733 DTMF,
RTCP demux, stats, the port pool, the asyncio receiver adapter, and a test/replay sender."""
