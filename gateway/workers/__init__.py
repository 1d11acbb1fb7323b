"""The gateway across processes: media workers (RTP receive and the ASR front end for a share of the
calls) and the main process's side of them. The engine process is asr_core.host."""
