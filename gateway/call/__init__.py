"""One call: the pure per-call core (`core`) with its inputs and effects (`contract`), what a call
takes from its INVITE (`invite`), where its legs' media and ASR streams run (`legs`), and the asyncio
front end that carries out the effects (`frontend`)."""
