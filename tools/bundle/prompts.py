"""The language prompt table of nemotron-3.5-asr-streaming (NeMo `model_defaults.prompt_dictionary`, also
HF's `DEFAULT_PROMPT_DICTIONARY`): locale or bare code -> prompt slot of the 128-wide one-hot.

Facts, not code: model_spec.md §7. `auto` (101) is language identification; the model then emits an
`<xx-XX>` tag piece for the language it heard.
"""

from __future__ import annotations

import re

PROMPT_DICTIONARY: dict[str, int] = {
    "en-US": 0, "en": 0, "en-GB": 1, "enGB": 1, "es-ES": 2, "esES": 2, "es-US": 3, "es": 3, "zh-CN": 4,
    "zh-ZH": 4, "zh-TW": 5, "hi-IN": 6, "hi": 6, "hi-HI": 6, "ar-AR": 7, "ar": 7, "fr-FR": 8, "fr": 8,
    "de-DE": 9, "de": 9, "ja-JP": 10, "ja-JA": 10, "ru-RU": 11, "ru": 11, "pt-BR": 12, "pt-PT": 13,
    "pt": 13, "ko-KR": 14, "ko": 14, "ko-KO": 14, "it-IT": 15, "it": 15, "nl-NL": 16, "nl": 16,
    "pl-PL": 17, "pl": 17, "tr-TR": 18, "tr": 18, "uk-UA": 19, "uk": 19, "ro-RO": 20, "ro": 20,
    "el-GR": 21, "el": 21, "cs-CZ": 22, "cs": 22, "hu-HU": 23, "hu": 23, "sv-SE": 24, "sv": 24,
    "da-DK": 25, "da": 25, "fi-FI": 26, "fi": 26, "no-NO": 27, "no": 27, "nb-NO": 103, "nb": 103,
    "nn-NO": 104, "nn": 104, "sk-SK": 28, "sk": 28, "hr-HR": 29, "hr": 29, "bg-BG": 30, "bg": 30,
    "lt-LT": 31, "lt": 31, "et-EE": 60, "et": 60, "lv-LV": 61, "lv": 61, "sl-SI": 62, "sl": 62,
    "th-TH": 32, "vi-VN": 33, "id-ID": 34, "ms-MY": 35, "bn-IN": 36, "ur-PK": 37, "fa-IR": 38, "ta-IN": 39,
    "te-IN": 40, "mr-IN": 41, "gu-IN": 42, "kn-IN": 43, "ml-IN": 44, "si-LK": 45, "ne-NP": 46, "km-KH": 47,
    "sw-KE": 48, "am-ET": 49, "ha-NG": 50, "zu-ZA": 51, "yo-NG": 52, "ig-NG": 53, "af-ZA": 54, "rw-RW": 55,
    "so-SO": 56, "ny-MW": 57, "ln-CD": 58, "or-KE": 59, "he-IL": 64, "ku-TR": 65, "az-AZ": 66, "ka-GE": 67,
    "hy-AM": 68, "uz-UZ": 69, "tg-TJ": 70, "ky-KG": 71, "qu-PE": 80, "ay-BO": 81, "gn-PY": 82,
    "nah-MX": 83, "mi-NZ": 96, "haw-US": 97, "sm-WS": 98, "to-TO": 99, "fr-CA": 100, "mt-MT": 102,
    "auto": 101,
}  # fmt: skip

AUTO_PROMPT_ID = 101
NUM_PROMPTS = 128

# The 40 supported locales (model_spec.md §7). Synthetic vocabularies carry one `<xx-XX>` tag piece per
# locale (the published one has 39 tag ids; which locale lacks its own is not known here).
SUPPORTED_LOCALES: tuple[str, ...] = (
    "en-US", "en-GB", "es-ES", "es-US", "hi-IN", "ar-AR", "fr-FR", "de-DE", "ja-JP", "ru-RU", "pt-BR",
    "pt-PT", "ko-KR", "it-IT", "nl-NL", "tr-TR", "uk-UA", "vi-VN", "fr-CA", "zh-CN", "pl-PL", "ro-RO",
    "cs-CZ", "hu-HU", "sv-SE", "da-DK", "fi-FI", "sk-SK", "hr-HR", "bg-BG", "et-EE", "nb-NO", "el-GR",
    "lt-LT", "th-TH", "lv-LV", "sl-SI", "he-IL", "mt-MT", "nn-NO",
)  # fmt: skip

# What a language-tag piece looks like (the HF converter's pattern).
LANGUAGE_TAG_RE = re.compile(r"^<[a-z]{2,3}-[A-Za-z]{2}>$")
