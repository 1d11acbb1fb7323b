"""Coverage-guided fuzzing of the gateway's parsers (atheris/libFuzzer); see docs/fuzzing.md."""
