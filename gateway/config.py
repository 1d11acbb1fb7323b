"""Deployment settings: environment variables `TTG_<SECTION>__<FIELD>` (pydantic-settings).

Read only at the edge (the daemon and the CLI); cores get plain dataclasses built from these.
The seed Rust server's NEMO_* variables are accepted as aliases (a TTG_* variable wins).
`ops/env.example` lists every variable; tests/test_env_example.py keeps it true.
Each section belongs to the package that uses it; add fields with a one-line description.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class ModelSettings(BaseModel):
    dir: str = Field("", description="Model bundle directory; empty = the embedded demo model")
    precision: Literal["auto", "f32", "f16", "bf16"] = Field(
        "auto", description="Encoder precision; auto = f32 on CPU, f16 on a GPU"
    )
    mel_filters: str = Field("", description="Override path of melfilters.f32 (default: in the bundle)")
    encoder_weights: str = Field("", description="Override path of encoder.safetensors (default: in the bundle)")
    encoder: Literal["mlx"] = Field("mlx", description="Encoder backend (only MLX)")


class AsrSettings(BaseModel):
    language: str = Field("en-US", description="Default call language (a prompt-table locale or 'auto')")
    lookahead: int | None = Field(None, description="Encoder lookahead in 80 ms frames; empty = bundle default")


class EncoderSettings(BaseModel):
    max_batch: int = Field(64, ge=1, description="Most chunks (calls) in one encoder step")
    max_wait_ms: float = Field(10.0, ge=0, description="Longest a ready chunk waits for a fuller batch")


class DecoderSettings(BaseModel):
    workers: int = Field(2, ge=1, description="RNN-T decoder worker threads (one ORT session each)")


class SipSettings(BaseModel):
    host: str = Field("0.0.0.0", description="SIP bind address (UDP and TCP)")
    port: int = Field(5060, ge=1, le=65535, description="SIP port")
    advertised_host: str = Field("", description="Address put in Contact/SDP; empty = the bind address")
    max_calls: int = Field(200, ge=0, description="Concurrent calls admitted; more get 503 + Retry-After")
    allow_cidrs: list[str] = Field(
        default_factory=lambda: ["0.0.0.0/0", "::/0"], description="Source networks allowed to call (else 403)"
    )


class RtpSettings(BaseModel):
    host: str = Field("0.0.0.0", description="RTP bind address")
    port_min: int = Field(20000, ge=1024, le=65534, description="Lowest RTP port (even)")
    port_max: int = Field(30000, ge=1025, le=65535, description="Highest RTP port")


class RedisSettings(BaseModel):
    url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL")
    stream: str = Field("ttg:transcripts", description="The global transcript stream (the contract)")


class SinkSettings(BaseModel):
    spool_dir: str = Field("var/spool", description="Where durable events wait while Redis is down")


class HttpSettings(BaseModel):
    host: str = Field("127.0.0.1", description="Bind address of /metrics, /healthz, /readyz")
    port: int = Field(9108, ge=0, le=65535, description="HTTP port")


class LogSettings(BaseModel):
    level: str = Field("INFO", description="Log level")


# NEMO_* variable -> (section, field): the seed server's names keep working.
NEMO_ALIASES: dict[str, tuple[str, str]] = {
    "NEMO_MODEL_DIR": ("model", "dir"),
    "NEMO_MEL_FILTERS": ("model", "mel_filters"),
    "NEMO_ENCODER": ("model", "encoder"),
    "NEMO_MLX_WEIGHTS": ("model", "encoder_weights"),
    "NEMO_MLX_PRECISION": ("model", "precision"),
    "NEMO_BATCH_MAX": ("encoder", "max_batch"),
    "NEMO_WORKERS": ("decoder", "workers"),
}


class _NemoAliasSource(PydanticBaseSettingsSource):
    """Settings from the NEMO_* aliases; ranked below TTG_* variables."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        out: dict[str, dict[str, str]] = {}
        for var, (section, name) in NEMO_ALIASES.items():
            value = os.environ.get(var)
            if value is not None and value != "":
                out.setdefault(section, {})[name] = value
        return out


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TTG_", env_nested_delimiter="__", extra="ignore")

    model: ModelSettings = ModelSettings()
    asr: AsrSettings = AsrSettings()
    encoder: EncoderSettings = EncoderSettings()
    decoder: DecoderSettings = DecoderSettings()
    sip: SipSettings = SipSettings()
    rtp: RtpSettings = RtpSettings()
    redis: RedisSettings = RedisSettings()
    sink: SinkSettings = SinkSettings()
    http: HttpSettings = HttpSettings()
    log: LogSettings = LogSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # TTG_* beats NEMO_*: pydantic-settings deep-merges sources, earlier ones win.
        return (init_settings, env_settings, _NemoAliasSource(settings_cls), dotenv_settings)


def env_variables() -> list[tuple[str, str, str]]:
    """Every TTG_* variable as (name, default, description), for env.example and the README table."""
    rows: list[tuple[str, str, str]] = []
    for section, finfo in Settings.model_fields.items():
        model_cls = finfo.annotation
        assert isinstance(model_cls, type) and issubclass(model_cls, BaseModel)
        for name, f in model_cls.model_fields.items():
            default = f.get_default(call_default_factory=True)
            if isinstance(default, list):
                text = "[" + ",".join(f'"{x}"' for x in default) + "]"
            elif default is None:
                text = ""
            else:
                text = str(default)
            rows.append((f"TTG_{section.upper()}__{name.upper()}", text, f.description or ""))
    return rows
