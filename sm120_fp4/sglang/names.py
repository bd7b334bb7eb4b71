"""SGLang's top-level import name: the one name the start-up hook (sm120_fp4.bootstrap) waits for.
Stdlib-only and importing nothing: it is read in every interpreter's start-up with the toggle on."""

TOP_LEVEL = "sglang"
