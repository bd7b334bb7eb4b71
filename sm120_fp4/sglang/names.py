"""SGLang's top-level import name, read by the start-up hook in every interpreter: stdlib-only, importing nothing."""

TOP_LEVEL = "sglang"
