"""`ttg replay`: the synthetic call-load replay tool (SIP UAC + paced RTP + Redis readback + reports).

In-process API (tests, scripts):

    from tools.replay import ReplayConfig, LoadConfig, run_replay
    report = run_replay(ReplayConfig(target=("127.0.0.1", 5060), generate=5, load=LoadConfig(calls=5)))
    assert report.summary.failed == 0

`run_replay_async` is the same coroutine for callers already inside an event loop.
"""

from tools.replay.config import Impairments, LanguageMix, LoadConfig, MediaConfig, ReplayConfig
from tools.replay.report import CallResult, Report, Summary
from tools.replay.runner import ReplayError, load_audio, run_replay, run_replay_async

__all__ = [
    "CallResult",
    "Impairments",
    "LanguageMix",
    "LoadConfig",
    "MediaConfig",
    "ReplayConfig",
    "ReplayError",
    "Report",
    "Summary",
    "load_audio",
    "run_replay",
    "run_replay_async",
]
