"""asyncgpu._devices.cuda.compiler: CUDA C++ -> cubin with NVRTC, and its two caches.

These tests need NVRTC (the ``nvidia-cuda-nvrtc`` wheel) but no GPU and no
driver: NVRTC compiles for any architecture on any machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from asyncgpu import _config
from asyncgpu._devices.cuda import compiler as _compiler
from asyncgpu._devices.cuda.compiler import (
    CompiledModule,
    clear_memory_cache,
    compile_cuda,
    default_cache_dir,
    dump_sass,
    nvrtc_version,
    write_dump,
)
from asyncgpu._errors import CompileError

REPO = Path(__file__).resolve().parents[2]

AXPY = r"""
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

# SCALE must come from the options (-DSCALE=...), so the options change the code.
SCALED = r"""
extern "C" __global__ void scale(float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= SCALE;
}
"""


def _nvrtc_available() -> bool:
    try:
        nvrtc_version()
    except CompileError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC is not installed")


@pytest.fixture(autouse=True)
def _fresh_memory_cache():
    """Each test starts with an empty in-process cache (its disk cache is its tmp_path)."""
    clear_memory_cache()
    yield
    clear_memory_cache()


def kernel_files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*.kernel"))


def run_fresh_python(code: str, cache_dir: Path) -> dict:
    """Run ``code`` in a new interpreter whose default cache dir is ``cache_dir``;
    it prints one JSON object, which is returned."""
    env = dict(os.environ)
    env["ASYNCGPU_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


FRESH_PROCESS_COMPILE = """
import hashlib, json, sys
from asyncgpu._devices.cuda.compiler import compile_cuda
m = compile_cuda({src!r}, "axpy", arch="sm_90", options={options!r}, want_ptx=True)
print(json.dumps({{
    "cache_hit": m.cache_hit,
    "cubin_sha256": hashlib.sha256(m.cubin).hexdigest(),
    "ptx": m.ptx,
    "log": m.log,
    "cuda_modules_imported": sorted(k for k in sys.modules if k.startswith("cuda")),
}}))
"""


# --------------------------------------------------------------------------- compiling


@needs_nvrtc
def test_compiles_an_extern_c_kernel_to_a_cubin_and_ptx_for_sm90(tmp_path):
    m = compile_cuda(AXPY, "axpy", arch="sm_90", want_ptx=True, cache_dir=tmp_path)

    assert isinstance(m, CompiledModule)
    assert (m.name, m.arch) == ("axpy", "sm_90")
    assert m.cubin[:4] == b"\x7fELF"  # machine code, not PTX for the driver to JIT
    assert m.ptx is not None
    assert ".entry axpy" in m.ptx
    assert ".target sm_90" in m.ptx
    assert m.log == ""  # clean code: NVRTC has nothing to say
    assert m.cache_hit is False


@needs_nvrtc
def test_ptx_is_none_unless_asked_for(tmp_path):
    m = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    assert m.ptx is None
    assert m.cubin[:4] == b"\x7fELF"


@needs_nvrtc
def test_nvrtc_command_line_flags_are_accepted_as_a_string_or_a_sequence(tmp_path):
    # -O3 is not an NVRTC flag; asyncgpu hands it to ptxas, as nvcc does for device code.
    flags = "-O3 --use_fast_math -std=c++17 -DSCALE=4.0f -lineinfo"
    as_string = compile_cuda(SCALED, "scale", arch="sm_90", options=flags, cache_dir=tmp_path)
    as_list = compile_cuda(SCALED, "scale", arch="sm_90", options=flags.split(), cache_dir=tmp_path)

    assert as_string.cubin[:4] == b"\x7fELF"
    assert as_list.cubin == as_string.cubin
    assert as_list.cache_hit  # the same flags, however spelled, are the same disk entry


@needs_nvrtc
def test_ptxas_verbose_output_lands_in_the_log(tmp_path):
    m = compile_cuda(AXPY, "axpy", arch="sm_90", options="-Xptxas -v", cache_dir=tmp_path)
    assert "Compiling entry function 'axpy' for 'sm_90'" in m.log
    assert "registers" in m.log


@needs_nvrtc
def test_nvrtc_version_is_major_minor():
    major, minor = nvrtc_version()
    assert isinstance(major, int) and isinstance(minor, int)
    assert major >= 12


# --------------------------------------------------------------------------- errors


@needs_nvrtc
def test_a_syntax_error_raises_compile_error_carrying_nvrtcs_log(tmp_path):
    broken = 'extern "C" __global__ void axpy(float* y) { y[0] = 1.0f }'  # missing ';'

    with pytest.raises(CompileError) as info:
        compile_cuda(broken, "axpy", arch="sm_90", cache_dir=tmp_path)

    err = info.value
    assert "'axpy'" in str(err) and "sm_90" in str(err)
    assert "error" in err.log
    assert 'expected a ";"' in err.log  # NVRTC's own words
    assert "axpy.cu(1)" in err.log  # with the line it points at
    assert kernel_files(tmp_path) == []  # failures are not cached


@needs_nvrtc
def test_an_unknown_flag_raises_compile_error_naming_it(tmp_path):
    with pytest.raises(CompileError) as info:
        compile_cuda(AXPY, "axpy", arch="sm_90", options="--no-such-flag", cache_dir=tmp_path)
    assert "--no-such-flag" in info.value.log


@needs_nvrtc
@pytest.mark.parametrize(
    "options",
    ["-arch=sm_80", "--gpu-architecture=sm_80", "-arch sm_80", ["-arch", "compute_90"]],
)
def test_options_naming_another_architecture_raise_value_error(tmp_path, options):
    with pytest.raises(ValueError, match="arch"):
        compile_cuda(AXPY, "axpy", arch="sm_90", options=options, cache_dir=tmp_path)


@needs_nvrtc
def test_options_repeating_the_same_architecture_are_fine(tmp_path):
    m = compile_cuda(AXPY, "axpy", arch="sm_90", options="-arch=sm_90", cache_dir=tmp_path)
    assert m.cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("arch", ["90", "compute_90", "sm90", ""])
def test_arch_must_be_a_real_sm_architecture(tmp_path, arch):
    with pytest.raises(ValueError, match="sm_90"):
        compile_cuda(AXPY, "axpy", arch=arch, cache_dir=tmp_path)


@needs_nvrtc
def test_a_kernel_name_missing_from_the_code_raises_compile_error(tmp_path):
    with pytest.raises(CompileError, match=r"'saxpy' not found.*kernels found: axpy"):
        compile_cuda(AXPY, "saxpy", arch="sm_90", cache_dir=tmp_path)


@needs_nvrtc
def test_kernels_must_be_extern_c(tmp_path):
    cxx = "__global__ void axpy(float* y) { y[0] = 1.0f; }"  # C++ linkage: mangled symbol
    with pytest.raises(CompileError, match='extern "C"'):
        compile_cuda(cxx, "axpy", arch="sm_90", cache_dir=tmp_path)


def test_missing_nvrtc_raises_compile_error_with_the_install_hint(tmp_path):
    code = (
        "import json, sys\n"
        "sys.modules['cuda.bindings'] = None  # as if cuda-bindings were not installed\n"
        "from asyncgpu._devices.cuda.compiler import compile_cuda\n"
        "from asyncgpu._errors import CompileError\n"
        "try:\n"
        f"    compile_cuda({AXPY!r}, 'axpy', arch='sm_90')\n"
        "except CompileError as e:\n"
        "    print(json.dumps({'error': str(e)}))\n"
    )
    out = run_fresh_python(code, tmp_path)
    assert "NVRTC" in out["error"]
    assert "pip install asyncgpu[cuda]" in out["error"]


# --------------------------------------------------------------------------- caching


@needs_nvrtc
def test_a_repeat_call_is_served_from_the_in_process_cache(tmp_path):
    cold = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    warm = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    again = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)

    assert cold.cache_hit is False
    assert warm.cache_hit is True
    assert warm.cubin == cold.cubin
    assert again is warm  # a repeat is one dictionary lookup returning the stored result


@needs_nvrtc
def test_a_fresh_process_is_served_from_disk_without_loading_nvrtc(tmp_path):
    options = "-DSCALE=2 -Xptxas -v"
    here = compile_cuda(
        AXPY, "axpy", arch="sm_90", options=options, want_ptx=True, cache_dir=tmp_path
    )
    assert len(kernel_files(tmp_path)) == 1

    there = run_fresh_python(FRESH_PROCESS_COMPILE.format(src=AXPY, options=options), tmp_path)

    assert there["cache_hit"] is True
    assert there["cubin_sha256"] == hashlib.sha256(here.cubin).hexdigest()
    assert there["ptx"] == here.ptx
    assert there["log"] == here.log  # ptxas -v info survives the cache
    assert there["cuda_modules_imported"] == []  # a hit needs no NVRTC, not even cuda-python


needs_nvrtc_wheel = pytest.mark.skipif(
    _compiler._wheel_nvrtc_fingerprint() is None, reason="NVRTC does not come from a wheel here"
)


@needs_nvrtc
@needs_nvrtc_wheel
def test_an_entry_keyed_by_the_nvrtc_version_is_a_hit_and_is_copied_under_the_files_key(
    tmp_path, monkeypatch
):
    # As a cache written where NVRTC came from elsewhere (or before entries were
    # keyed by the wheel's file) has it: keyed by the version alone.
    with monkeypatch.context() as m:
        m.setattr(_compiler, "_file_tag", lambda: None)
        first = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    assert len(kernel_files(tmp_path)) == 1
    clear_memory_cache()

    again = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)  # the version's entry
    assert again.cache_hit is True and again.cubin == first.cubin
    assert len(kernel_files(tmp_path)) == 2  # ... now also under the file's key

    there = run_fresh_python(FRESH_PROCESS_COMPILE.format(src=AXPY, options=""), tmp_path)
    assert there["cache_hit"] is True and there["cuda_modules_imported"] == []


@needs_nvrtc
@needs_nvrtc_wheel
def test_entries_are_keyed_by_the_version_when_the_loaded_nvrtc_is_not_the_wheels(
    tmp_path, monkeypatch
):
    nvrtc_version()  # (loaded)
    monkeypatch.setattr(_compiler, "_loaded_is_wheel", False)
    assert _compiler._file_tag() is None
    compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    opts = _compiler._final_options((), "sm_90")
    by_version = _compiler._disk_key(AXPY, "axpy", opts, "sm_90", _compiler._version_tag())
    assert [p.name for p in kernel_files(tmp_path)] == [f"{by_version.hex()}.kernel"]


@needs_nvrtc
def test_a_fresh_process_with_an_empty_cache_compiles(tmp_path):
    code = FRESH_PROCESS_COMPILE.format(src=AXPY, options="")
    first = run_fresh_python(code, tmp_path)
    second = run_fresh_python(code, tmp_path)

    assert first["cache_hit"] is False
    assert second["cache_hit"] is True
    assert second["cubin_sha256"] == first["cubin_sha256"]


@needs_nvrtc
@pytest.mark.parametrize(
    "change",
    [
        {"options": "-DSCALE=3.0f"},
        {"arch": "sm_80"},
        {"source": SCALED.replace("*=", "+=")},
    ],
    ids=["options", "arch", "source"],
)
def test_options_arch_and_source_each_key_their_own_entry(tmp_path, change):
    base = {"source": SCALED, "options": "-DSCALE=2.0f", "arch": "sm_90"}
    varied = {**base, **change}

    def build(spec: dict) -> CompiledModule:
        return compile_cuda(
            spec["source"], "scale", arch=spec["arch"], options=spec["options"], cache_dir=tmp_path
        )

    first, other = build(base), build(varied)

    assert first.cache_hit is False
    assert other.cache_hit is False
    assert other.cubin != first.cubin
    assert len(kernel_files(tmp_path)) == 2
    clear_memory_cache()  # both are now served from disk, each from its own entry
    assert build(base).cubin == first.cubin
    assert build(varied).cubin == other.cubin


@needs_nvrtc
def test_an_entry_written_without_ptx_asked_for_serves_a_later_ptx_request_from_disk(tmp_path):
    # compile_function asks for the PTX (it reads the kernel's signature from it):
    # a kernel another process compiled without asking for it must still be a hit.
    cubin_only = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    with_ptx = compile_cuda(AXPY, "axpy", arch="sm_90", want_ptx=True, cache_dir=tmp_path)
    clear_memory_cache()
    plain = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)

    assert cubin_only.cache_hit is False and cubin_only.ptx is None
    assert with_ptx.cache_hit is True
    assert with_ptx.ptx is not None and ".entry axpy" in with_ptx.ptx
    assert with_ptx.cubin == cubin_only.cubin
    assert plain.cache_hit is True and plain.ptx is None
    assert len(kernel_files(tmp_path)) == 1


@needs_nvrtc
def test_an_old_entry_without_ptx_is_recompiled_once_for_a_ptx_request(tmp_path):
    from asyncgpu._devices.cuda import compiler as _compiler

    compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    (path,) = kernel_files(tmp_path)
    data = path.read_bytes()
    _, key, n_cubin, n_ptx, _, _ = _compiler._HEADER.unpack_from(data)
    body = data[_compiler._HEADER.size :]
    cubin, log = body[:n_cubin], body[n_cubin + n_ptx :].decode()
    # An entry without the PTX, as older versions wrote them.
    path.write_bytes(_compiler._pack_entry(key, cubin, None, log))
    clear_memory_cache()

    with_ptx = compile_cuda(AXPY, "axpy", arch="sm_90", want_ptx=True, cache_dir=tmp_path)
    clear_memory_cache()
    again = compile_cuda(AXPY, "axpy", arch="sm_90", want_ptx=True, cache_dir=tmp_path)

    assert with_ptx.cache_hit is False and with_ptx.ptx is not None
    assert again.cache_hit is True and again.ptx == with_ptx.ptx
    assert len(kernel_files(tmp_path)) == 1


def _torn(data: bytes) -> bytes:
    return data[:-10]


def _bit_flipped(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


@needs_nvrtc
@pytest.mark.parametrize("damage", [_torn, _bit_flipped], ids=["torn", "bit-flipped"])
def test_a_corrupt_disk_entry_is_a_miss_and_is_rewritten(tmp_path, damage):
    good = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    (entry,) = kernel_files(tmp_path)
    entry.write_bytes(damage(entry.read_bytes()))
    clear_memory_cache()

    rebuilt = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    clear_memory_cache()
    served = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)

    assert rebuilt.cache_hit is False and rebuilt.cubin == good.cubin
    assert served.cache_hit is True and served.cubin == good.cubin


@needs_nvrtc
def test_use_cache_false_neither_reads_nor_writes(tmp_path):
    compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path / "warm")
    m = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path / "cold", use_cache=False)

    assert m.cache_hit is False
    assert not (tmp_path / "cold").exists()


@needs_nvrtc
def test_concurrent_calls_for_one_kernel_compile_it_once(tmp_path):
    hits: list[bool] = []
    lock = threading.Lock()

    def compile_once() -> None:
        m = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
        with lock:
            hits.append(m.cache_hit)

    threads = [threading.Thread(target=compile_once) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(hits) == [False] + [True] * 7


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    """Read once, at import (``_config``): here through the reader and the
    settings the package reads."""
    mine, xdg = str(tmp_path / "mine"), str(tmp_path / "xdg")
    for env, expected in (
        ({"ASYNCGPU_CACHE_DIR": mine, "XDG_CACHE_HOME": xdg}, tmp_path / "mine"),
        ({"XDG_CACHE_HOME": xdg}, tmp_path / "xdg" / "asyncgpu" / "kernels"),
        ({}, Path.home() / ".cache" / "asyncgpu" / "kernels"),
    ):
        settings = _config.SETTINGS.replace(cache_dir=_config.read_cache_dir(env))
        monkeypatch.setattr(_config, "SETTINGS", settings)
        assert default_cache_dir() == expected


# --------------------------------------------------------------------------- dumps


def test_write_dump_false_does_nothing_and_true_returns_the_text(tmp_path):
    assert write_dump(".version 9.0", False, ".ptx") is None
    assert write_dump(".version 9.0", True, ".ptx") == ".version 9.0"


def test_write_dump_to_a_path_writes_the_file_and_returns_its_path(tmp_path):
    target = tmp_path / "out" / "axpy.ptx"  # parent directories are created
    assert write_dump(".version 9.0", target, ".ptx") == str(target)
    assert target.read_text() == ".version 9.0"

    as_str = str(tmp_path / "%-dump.ptx")  # '%' stands for the kernel name
    assert write_dump("x", as_str, ".ptx", name="axpy") == str(tmp_path / "axpy-dump.ptx")

    # An existing directory receives <name><suffix>.
    assert write_dump("y", tmp_path, ".sass", name="axpy") == str(tmp_path / "axpy.sass")
    assert (tmp_path / "axpy.sass").read_text() == "y"


def _have_disassembler() -> bool:
    if shutil.which("cuobjdump") or shutil.which("nvdisasm"):
        return True
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return False
    return bool(find_nvidia_binary_utility("cuobjdump") or find_nvidia_binary_utility("nvdisasm"))


@needs_nvrtc
def test_dump_sass_disassembles_with_cuda_tools_or_returns_none(tmp_path):
    m = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=tmp_path)
    sass = dump_sass(m.cubin)
    if _have_disassembler():
        assert sass is not None and "axpy" in sass and "EXIT" in sass
    else:
        assert sass is None


# --------------------------------------------------------------------------- included files

INCLUDES = r"""
#include "scale.h"
extern "C" __global__ void scale(float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] *= SCALE;
}
"""


@needs_nvrtc
def test_an_edited_header_is_a_cache_miss_not_a_stale_kernel(tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "scale.h").write_text('#include "factor.h"\n#define SCALE FACTOR\n')
    (inc / "factor.h").write_text("#define FACTOR 2.0f\n")
    cache = tmp_path / "cache"
    opts = f"-I{inc}"
    first = compile_cuda(INCLUDES, "scale", arch="sm_90", options=opts, cache_dir=cache)
    again = compile_cuda(INCLUDES, "scale", arch="sm_90", options=opts, cache_dir=cache)
    assert (first.cache_hit, again.cache_hit) == (False, True)
    assert again.cubin == first.cubin
    # An edit two levels down (same length) changes the kernel.
    (inc / "factor.h").write_text("#define FACTOR 3.0f\n")
    edited = compile_cuda(INCLUDES, "scale", arch="sm_90", options=opts, cache_dir=cache)
    assert edited.cache_hit is False and edited.cubin != first.cubin
    assert len(kernel_files(cache)) == 2
    # Back to the first header: the first entry again, from the in-process cache or disk.
    (inc / "factor.h").write_text("#define FACTOR 2.0f\n")
    clear_memory_cache()
    back = compile_cuda(INCLUDES, "scale", arch="sm_90", options=opts, cache_dir=cache)
    assert back.cache_hit is True and back.cubin == first.cubin


def test_include_digest_follows_quoted_and_i_path_includes_and_ends_cycles(tmp_path):
    (tmp_path / "a.h").write_text('#include "b.h"\n// #include "gone.h"\n')
    (tmp_path / "b.h").write_text('#include "a.h"\n#include <cuda_fp16.h>\n')
    opts = (f"-I{tmp_path}", "-arch=sm_90")
    digest = _compiler._include_digest('#include "a.h"\n', opts)
    assert digest  # both files, each once: the cycle ends
    (tmp_path / "b.h").write_text('#include "a.h"\n#include <cuda_fp16.h>\n// edited\n')
    assert _compiler._include_digest('#include "a.h"\n', opts) not in (b"", digest)
    # Nothing included from disk: the key the source always had.
    assert _compiler._include_digest("#include <cuda_fp16.h>\n", opts) == b""
    assert _compiler._include_digest(AXPY, opts) == b""
    # Separate flag forms.
    assert _compiler._include_digest('#include "a.h"\n', ("-I", str(tmp_path))) == (
        _compiler._include_digest('#include "a.h"\n', (f"--include-path={tmp_path}",))
    )


def test_a_source_whose_includes_cannot_be_followed_is_not_cached(tmp_path, monkeypatch):
    opts = ("-arch=sm_90",)
    assert _compiler._include_digest('#include "nowhere.h"\n', opts) is None
    assert _compiler._include_digest("#define H <x.h>\n#include H\n", opts) is None
    compiled: list[str] = []

    def fake_compile(source, name, arch, opts, want_ptx):
        compiled.append(name)
        return b"cubin", None, ""

    monkeypatch.setattr(_compiler, "_nvrtc_compile", fake_compile)
    for _ in range(2):
        m = compile_cuda('#include "nowhere.h"\n', "k", arch="sm_90", cache_dir=tmp_path)
        assert m.cache_hit is False
    assert compiled == ["k", "k"] and kernel_files(tmp_path) == []


# --------------------------------------------------------------------------- trusting the cache


@pytest.fixture
def _fresh_trust(monkeypatch):
    """Each test warns anew about the directories it distrusts."""
    monkeypatch.setattr(_compiler, "_untrusted_dirs", set())


@needs_nvrtc
def test_the_cache_directory_is_created_private(tmp_path):
    cache = tmp_path / "a" / "kernels"
    compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=cache)
    assert cache.stat().st_mode & 0o777 == 0o700
    assert kernel_files(cache) and all(f.stat().st_mode & 0o077 == 0 for f in kernel_files(cache))


@needs_nvrtc
def test_a_directory_others_may_write_to_is_skipped_with_one_warning(tmp_path, _fresh_trust):
    cache = tmp_path / "shared"
    compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=cache)
    entries = kernel_files(cache)
    cache.chmod(0o777)
    clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="not trusted"):
        m = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=cache)
    assert m.cache_hit is False  # the entry there was not read
    clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (once per directory)
        compile_cuda(SCALED, "scale", arch="sm_90", options="-DSCALE=2", cache_dir=cache)
    assert kernel_files(cache) == entries  # nothing written there


@needs_nvrtc
@pytest.mark.parametrize("how", ["another owner", "group-writable"])
def test_an_entry_not_the_users_own_is_skipped(tmp_path, _fresh_trust, how):
    cache = tmp_path / "kernels"
    compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=cache)
    (entry,) = kernel_files(cache)
    if how == "another owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(entry, os.geteuid() + 4242, -1)
    else:
        entry.chmod(0o664)
    clear_memory_cache()
    with pytest.warns(RuntimeWarning, match="not trusted"):
        m = compile_cuda(AXPY, "axpy", arch="sm_90", cache_dir=cache)
    assert m.cache_hit is False
