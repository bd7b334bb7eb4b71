"""Code that runs in spawned children (importable without pytest)."""


def report_alias_patch(queue):
    """Import SGLang's FP4 module as a scheduler would, and report whether its alias is patched."""
    import sglang.srt.layers.quantization.modelopt_quant as mq

    queue.put(getattr(mq.flashinfer_fp4_gemm, "__sm120_fp4_patch__", None))
