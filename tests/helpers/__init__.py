"""Helpers shared by the test files (one place): import the submodule you need.

    helpers.common    settings, mocked devices, thread runner, SGLang patch assertions
    helpers.procs     subprocess runners and the background-job decorator (see conftest)
    helpers.cases     the @case(area, case, expected) declarations behind RELIABILITY.md
    helpers.faults    misbehaving GEMM backends built on the oracle
    helpers.children  code that runs in spawned children (no torch/SGLang at import)
    helpers.checkpoints  the demo's tiny checkpoint in ModelOpt's or compressed-tensors' format
    helpers.scalar_recipe  an independent scalar statement of the NVFP4 recipe

Nothing here imports torch, SGLang or sm120_fp4 at package import: a spawned child imports
``helpers.children`` before it registers its backend.
"""
