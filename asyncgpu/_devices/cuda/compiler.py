"""CUDA C++ to cubin with NVRTC, with an in-process and an on-disk cache.

``compile_cuda`` turns CUDA C++ source into machine code (a cubin: SASS for one
real architecture such as ``sm_90``) so the device never JIT-compiles PTX. It
talks to NVRTC through ``cuda.bindings.nvrtc`` (``nvrtcCreateProgram``,
``nvrtcCompileProgram``, ``nvrtcGetCUBIN``, ``nvrtcGetPTX``,
``nvrtcGetProgramLog``). ``cuda.core.Program`` is not used: it takes only
``ProgramOptions`` (no raw command-line flags) and its PTX target goes through
the driver, while NVRTC itself needs neither a GPU nor a driver.

Kernels must be ``extern "C"``: the entry name given to ``compile_cuda`` is the
symbol looked up in the cubin's ELF symbol table after compiling (a C++-mangled
``__global__`` function is reported with a hint to add ``extern "C"``).

Caching
-------
Two levels, both keyed by source, kernel name, the final NVRTC flags, the
architecture and the NVRTC that compiles:

* in-process: a dict from the call's own arguments to the finished
  ``CompiledModule``; a repeat call is one dictionary lookup.
* on disk (``default_cache_dir()`` unless ``cache_dir`` is given): one file per
  kernel, written atomically (temporary file + ``os.replace``) and checked on
  read (magic, key digest, lengths, CRC-32), so concurrent processes and
  crashes never serve a torn entry; a bad entry is a miss and is rewritten.
  The directory is created private to the user (0700). A directory or an entry
  that is not the user's own (``os.geteuid()``) or that others may write to
  (group or world write bit) is not trusted, as compilers' caches do: its
  entries are skipped and nothing is written there, with one warning per
  directory (another local user could otherwise plant code that runs on the GPU).

A hit costs no NVRTC call and imports nothing from cuda-python (importing
``cuda.core`` alone costs more than compiling a small kernel, which is why the
disk cache is files of our own rather than ``cuda.core.utils.FileStreamProgramCache``).
The NVRTC in the key is named without loading NVRTC where that is safe: the
NVRTC library of the ``nvidia-cuda-nvrtc`` wheel is located by ``stat`` alone,
and an entry compiled by NVRTC loaded from that very file is keyed by the
file's (path, size, mtime), so a fresh process finds it with one file read.
Where NVRTC comes from elsewhere (a system CUDA toolkit, conda), entries are
keyed by the NVRTC version, and the first lookup in a process loads NVRTC to ask
``nvrtcVersion`` (an entry of that kind found while the wheel's NVRTC is the
one loaded is copied under the file's key, once).

Files pulled in by ``#include`` are part of both keys, by content, followed
recursively (``_include_digest``): ``#include "f"`` is looked up in the
including file's directory (the current directory for the source itself, as
NVRTC does), then in the ``-I`` / ``--include-path`` directories;
``#include <f>`` in the ``-I`` directories only, and where it is not found there
it is a system or NVRTC built-in header, which the NVRTC in the key stands for.
Files named by ``--pre-include`` / ``-include`` count as quoted includes. A
source whose quoted include cannot be found, or that includes through a macro,
is compiled without either cache. A source with includes pays a read of each
included file on every call (an edited header is then a miss, never a stale
kernel); one without pays nothing for it.

Every function here blocks the calling thread; call them from a worker thread
(``asyncio.to_thread``) when an event loop must keep running.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shlex
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ... import _config
from ..._errors import CompileError

__all__ = [
    "CompiledModule",
    "clear_memory_cache",
    "compile_cuda",
    "default_cache_dir",
    "dump_sass",
    "nvrtc_version",
    "write_dump",
]

_INSTALL_HINT = "install it with `pip install asyncgpu[cuda]` (the nvidia-cuda-nvrtc wheel)"


@dataclass(frozen=True)
class CompiledModule:
    """The result of ``compile_cuda``: machine code for one kernel and one arch."""

    name: str
    """The kernel (entry) name, an ``extern "C"`` ``__global__`` function."""
    arch: str
    """The real architecture the cubin is for, e.g. ``"sm_90"``."""
    cubin: bytes
    """ELF machine code (SASS) for ``arch``; loading it involves no PTX JIT."""
    ptx: str | None
    """The PTX text when it was asked for (``want_ptx=True``), else ``None``."""
    log: str
    """NVRTC's log (warnings, ``-Xptxas -v`` info); ``''`` when empty."""
    cache_hit: bool
    """True when served from the in-process or the on-disk cache."""

    def __repr__(self) -> str:
        ptx = "None" if self.ptx is None else f"<{len(self.ptx)} chars>"
        return (
            f"CompiledModule(name={self.name!r}, arch={self.arch!r}, "
            f"cubin=<{len(self.cubin)} bytes>, ptx={ptx}, log={self.log!r}, "
            f"cache_hit={self.cache_hit})"
        )


# --------------------------------------------------------------------------- paths


def default_cache_dir() -> Path:
    """The on-disk kernel cache: ``$ASYNCGPU_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/asyncgpu/kernels``, else ``~/.cache/asyncgpu/kernels``
    (read once, at import: ``_config``).

    Pure path arithmetic (no NVRTC or driver call); the directory is created on
    the first write, not here."""
    return Path(_default_cache_dir())


def _default_cache_dir() -> str:
    """``default_cache_dir()`` as a str, with ``os.path`` (a fresh process's
    first cache lookup: pathlib's first use costs more than the lookup)."""
    return _config.SETTINGS.cache_dir


# --------------------------------------------------------------------------- NVRTC loading

_nvrtc_mod: Any = None
_real_version: tuple[int, int] | None = None
_load_lock = threading.Lock()


def _nvrtc() -> Any:
    """``cuda.bindings.nvrtc`` with the NVRTC library loaded, or CompileError."""
    global _nvrtc_mod, _real_version
    if _nvrtc_mod is not None:
        return _nvrtc_mod
    with _load_lock:
        if _nvrtc_mod is not None:
            return _nvrtc_mod
        try:
            from cuda.bindings import nvrtc
        except ImportError as exc:
            raise CompileError(
                f"NVRTC is not available: cuda.bindings is not installed ({exc}); {_INSTALL_HINT}"
            ) from exc
        try:
            err, major, minor = nvrtc.nvrtcVersion()
        except Exception as exc:  # the library itself could not be found or loaded
            raise CompileError(
                f"NVRTC is not installed or could not be loaded ({exc}); {_INSTALL_HINT}"
            ) from exc
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"nvrtcVersion failed ({_err_name(err)}); {_INSTALL_HINT}")
        _real_version = (int(major), int(minor))
        _nvrtc_mod = nvrtc
        return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """``(major, minor)`` of the NVRTC library that compiles, from ``nvrtcVersion``.

    Loads NVRTC on first use (tens of milliseconds, blocking the calling thread);
    raises ``CompileError`` when NVRTC is not installed."""
    _nvrtc()
    assert _real_version is not None
    return _real_version


def _err_name(err: Any) -> str:
    return str(getattr(err, "name", err))


# Where the nvidia-cuda-nvrtc wheels put the library (the first place
# cuda.pathfinder looks, before conda and the system).
_WHEEL_LIBS = (
    ("nvidia", "cu13", "lib", "libnvrtc.so.13"),
    ("nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"),
)

_fingerprint: tuple[str, int, int] | None = None
_fingerprint_searched = False
_loaded_is_wheel: bool | None = None  # the loaded NVRTC is the fingerprinted file


def _wheel_nvrtc_fingerprint() -> tuple[str, int, int] | None:
    """(path, size, mtime_ns) of the wheel's libnvrtc on ``sys.path``, found
    by ``stat`` alone; None when NVRTC does not come from a wheel (or on
    Windows/macOS, where this shortcut is not used)."""
    global _fingerprint, _fingerprint_searched
    if _fingerprint_searched:
        return _fingerprint
    found: tuple[str, int, int] | None = None
    if sys.platform.startswith("linux"):
        for rel in _WHEEL_LIBS:
            for entry in sys.path:
                path = os.path.join(entry or ".", *rel)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                found = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
                break
            if found is not None:
                break
    _fingerprint, _fingerprint_searched = found, True
    return found


def _file_tag() -> str | None:
    """The compiler part of a key that names the wheel's NVRTC file, while that
    file is the NVRTC this process compiles with: the one loaded, or, before
    NVRTC is loaded, the one cuda.pathfinder will load (it looks in the wheels
    first). None otherwise."""
    global _loaded_is_wheel
    fp = _wheel_nvrtc_fingerprint()
    if fp is None:
        return None
    if _real_version is not None:
        if _loaded_is_wheel is None:
            try:
                from cuda.pathfinder import load_nvidia_dynamic_lib

                loaded = load_nvidia_dynamic_lib("nvrtc")  # cached: the loaded library
                _loaded_is_wheel = os.path.realpath(loaded.abs_path) == os.path.realpath(fp[0])
            except Exception:
                _loaded_is_wheel = False
        if not _loaded_is_wheel:
            return None
    return f"nvrtc-file {fp[0]} {fp[1]} {fp[2]}"


def _version_tag() -> str:
    """The compiler part of a key that names the NVRTC version (loads NVRTC)."""
    major, minor = nvrtc_version()
    return f"nvrtc {major}.{minor}"


# --------------------------------------------------------------------------- options

_ARCH_RE = re.compile(r"sm_(\d+)[a-z]?")
_ARCH_FLAGS = ("-arch", "--gpu-architecture")
_OPT_LEVEL_RE = re.compile(r"-O([0-3])")


def _final_options(options: str | Sequence[str], arch: str) -> tuple[str, ...]:
    """The NVRTC flag list: the user's flags with ``-arch`` checked and removed,
    ``-O<n>`` (which NVRTC rejects) handed to ptxas as ``--ptxas-options=-O<n>``
    like nvcc does for device code, and ``-arch=<arch>`` appended."""
    if isinstance(options, str):
        tokens = shlex.split(options)
    elif isinstance(options, (bytes, bytearray)):
        raise TypeError("options must be a str or a sequence of str, not bytes")
    else:
        tokens = list(options)
        for tok in tokens:
            if not isinstance(tok, str):
                raise TypeError(f"options must hold str flags, got {type(tok).__name__}")
    out: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        value: str | None = None
        if tok in _ARCH_FLAGS:
            if i + 1 >= len(tokens):
                raise ValueError(f"option {tok} needs a value")
            value = tokens[i + 1]
            i += 2
        else:
            flag, eq, rest = tok.partition("=")
            if eq and flag in _ARCH_FLAGS:
                value = rest
            i += 1
        if value is not None:
            if value != arch:
                raise ValueError(
                    f"options set the architecture to {value!r} but arch={arch!r}; "
                    "give the architecture through arch= only"
                )
            continue
        level = _OPT_LEVEL_RE.fullmatch(tok)
        out.append(f"--ptxas-options=-O{level.group(1)}" if level else tok)
    out.append(f"-arch={arch}")
    return tuple(out)


# --------------------------------------------------------------------------- disk entries

_SCHEMA = b"asyncgpu-kernel-cache-v1"
_MAGIC = b"AGPUKRN1"
# magic, key digest, cubin length, ptx length (or _NO_PTX), log length, crc32 of payload
_HEADER = struct.Struct("<8s32sQQQI")
_NO_PTX = (1 << 64) - 1


def _disk_key(
    source: str, name: str, opts: tuple[str, ...], arch: str, compiler: str, deps: bytes = b""
) -> bytes:
    h = hashlib.sha256()
    parts = [
        _SCHEMA,
        compiler.encode(),
        arch.encode(),
        name.encode(),
        "\0".join(opts).encode(),
        source.encode("utf-8", "surrogatepass"),
    ]
    if deps:  # (a source without includes keeps the key it always had)
        parts.append(deps)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


# --------------------------------------------------------------------------- included files

_INCLUDE_RE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*(?:"([^"\n]+)"|<([^>\n]+)>|(\S.*))', re.M)
_COMMENT_RE = re.compile(rb"//[^\n]*|/\*.*?\*/", re.S)
_INCLUDE_FLAGS = ("-I", "--include-path")
_PRE_INCLUDE_FLAGS = ("-include", "--pre-include")


def _include_options(opts: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The include directories (``-I`` / ``--include-path``, in order) and the
    pre-included files (``-include`` / ``--pre-include``) of the NVRTC flags."""
    dirs: list[str] = []
    pre: list[str] = []
    it = iter(opts)
    for tok in it:
        for flags, out in ((_INCLUDE_FLAGS, dirs), (_PRE_INCLUDE_FLAGS, pre)):
            for flag in flags:
                if tok == flag:
                    value = next(it, None)
                elif tok.startswith(flag + "="):
                    value = tok[len(flag) + 1 :]
                elif flag == "-I" and tok.startswith("-I"):
                    value = tok[2:]
                else:
                    continue
                if value is not None:
                    out.append(value)
                break
            else:
                continue
            break
    return dirs, pre


def _include_digest(source: str, opts: tuple[str, ...]) -> bytes | None:
    """What the files ``source`` includes contribute to the cache keys: b"" when
    it includes nothing from disk, else the resolved paths and a SHA-256 of the
    contents of every file it includes, recursively (each file once, so an
    include cycle ends); None when a quoted include cannot be found or an
    include is computed by a macro (such a source is not cached). Files reached
    through ``<...>`` are followed leniently: what they include that cannot be
    found is taken to be a system header."""
    text = source.encode("utf-8", "surrogatepass")
    if b"include" not in text and not any(o.startswith(_PRE_INCLUDE_FLAGS) for o in opts):
        return b""
    dirs, pre = _include_options(opts)
    h = hashlib.sha256()
    seen: set[str] = set()
    found = False
    # (file's text, its directory, strict: an include that cannot be resolved
    # refuses the cache); the pre-included files are quoted includes of the source.
    todo: list[tuple[bytes, str, bool]] = [(text, os.getcwd(), True)]
    for f in pre:
        todo.append((b'#include "' + f.encode() + b'"\n', os.getcwd(), True))
    while todo:
        data, here, strict = todo.pop()
        for quoted, angled, computed in _INCLUDE_RE.findall(_COMMENT_RE.sub(b"", data)):
            if computed:
                if strict:
                    return None
                continue
            rel = os.fsdecode(quoted or angled)
            where = ([here] if quoted else []) + dirs
            path = next(
                (p for p in (os.path.join(d, rel) for d in where) if os.path.isfile(p)), None
            )
            if path is None:
                if quoted and strict:
                    return None
                continue  # a system or NVRTC built-in header
            path = os.path.realpath(path)
            if path in seen:
                continue
            seen.add(path)
            try:
                with open(path, "rb") as fh:
                    content = fh.read()
            except OSError:
                return None
            found = True
            for part in (os.fsencode(path), hashlib.sha256(content).digest()):
                h.update(len(part).to_bytes(8, "little"))
                h.update(part)
            todo.append((content, os.path.dirname(path), strict and bool(quoted)))
    return h.digest() if found else b""


def _disk_lookup(
    directory: str,
    source: str,
    name: str,
    opts: tuple[str, ...],
    arch: str,
    want_ptx: bool,
    deps: bytes = b"",
) -> tuple[bytes, str | None, str] | None:
    """(cubin, ptx, log) of the entry in ``directory`` for this compilation, or
    None: first the entry keyed by the wheel's NVRTC file (no NVRTC load), then
    the one keyed by the NVRTC version (loads NVRTC; found while the wheel's
    NVRTC is the one loaded, it is copied under the file's key)."""
    if not _trusted(directory):
        return None
    tag = _file_tag()
    if tag is not None:
        key = _disk_key(source, name, opts, arch, tag, deps)
        entry = _read_entry(_entry_path(directory, key), key, want_ptx)
        if entry is not None:
            return entry
    key = _disk_key(source, name, opts, arch, _version_tag(), deps)
    entry = _read_entry(_entry_path(directory, key), key, want_ptx, keep_ptx=True)
    if entry is None:
        return None
    tag = _file_tag()  # (NVRTC is loaded now)
    if tag is not None:
        key = _disk_key(source, name, opts, arch, tag, deps)
        _atomic_write(_entry_path(directory, key), _pack_entry(key, *entry))
    cubin, ptx, log = entry
    return cubin, ptx if want_ptx else None, log


def _entry_path(cache_dir: str, key: bytes) -> str:
    return os.path.join(cache_dir, f"{key.hex()}.kernel")


def _pack_entry(key: bytes, cubin: bytes, ptx: str | None, log: str) -> bytes:
    ptx_b = b"" if ptx is None else ptx.encode("utf-8")
    log_b = log.encode("utf-8")
    payload = cubin + ptx_b + log_b
    header = _HEADER.pack(
        _MAGIC,
        key,
        len(cubin),
        _NO_PTX if ptx is None else len(ptx_b),
        len(log_b),
        zlib.crc32(payload),
    )
    return header + payload


def _read_entry(
    path: str, key: bytes, want_ptx: bool, keep_ptx: bool = False
) -> tuple[bytes, str | None, str] | None:
    """(cubin, ptx, log) from a verified entry, or None for a miss (absent,
    torn, corrupt, or without the PTX that was asked for). The PTX is None
    unless asked for, or ``keep_ptx`` and the entry has it."""
    try:
        with open(path, "rb") as f:
            if _not_own(os.fstat(f.fileno())):
                _warn_untrusted(os.path.dirname(path), f"the entry {os.path.basename(path)}")
                return None
            data = f.read()
    except OSError:
        return None
    if len(data) < _HEADER.size:
        return None
    magic, stored_key, n_cubin, n_ptx, n_log, crc = _HEADER.unpack_from(data)
    has_ptx = n_ptx != _NO_PTX
    n_ptx_bytes = n_ptx if has_ptx else 0
    if magic != _MAGIC or stored_key != key:
        return None
    if len(data) != _HEADER.size + n_cubin + n_ptx_bytes + n_log:
        return None
    if want_ptx and not has_ptx:
        return None
    payload = memoryview(data)[_HEADER.size :]
    if zlib.crc32(payload) != crc:
        return None
    cubin = bytes(payload[:n_cubin])
    read_ptx = want_ptx or (keep_ptx and has_ptx)
    ptx = bytes(payload[n_cubin : n_cubin + n_ptx_bytes]).decode("utf-8") if read_ptx else None
    log = bytes(payload[n_cubin + n_ptx_bytes :]).decode("utf-8")
    return cubin, ptx, log


def _not_own(st: os.stat_result) -> bool:
    """True for a file or directory this user does not own, or that others may
    write to (group or world write bit)."""
    return st.st_uid != os.geteuid() or bool(st.st_mode & 0o022)


_untrusted_dirs: set[str] = set()


def _warn_untrusted(directory: str, what: str) -> None:
    if directory in _untrusted_dirs:
        return
    _untrusted_dirs.add(directory)
    import warnings

    warnings.warn(
        f"asyncgpu: the kernel cache in {directory} is not trusted ({what} is not "
        "owned by this user or is writable by others): its entries are skipped and "
        "nothing is written there; make it private (chmod 700) or set ASYNCGPU_CACHE_DIR",
        RuntimeWarning,
        stacklevel=4,
    )


def _trusted(directory: str) -> bool:
    """False (with one warning) when the cache directory exists and is not the
    user's own or others may write to it; an absent one is made private."""
    try:
        st = os.stat(directory)
    except OSError:
        return True
    if _not_own(st):
        _warn_untrusted(directory, "the directory")
        return False
    return True


def _atomic_write(path: str, data: bytes) -> bool:
    """Write ``data`` to ``path`` so readers see the old file or the whole new
    one; False (and no exception) when the cache directory is not writable."""
    import tempfile

    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".part")
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return False


# --------------------------------------------------------------------------- NVRTC compile


def _check(nvrtc: Any, result: tuple[Any, ...], call: str) -> tuple[Any, ...]:
    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{call} failed: {_err_name(result[0])}")
    return result


def _program_log(nvrtc: Any, prog: Any) -> str:
    _, size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    if size <= 1:
        return ""
    buf = bytearray(size)
    _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    text = bytes(buf).rstrip(b"\0").decode("utf-8", "replace")
    return text if text.strip() else ""


def _nvrtc_compile(
    source: str, name: str, arch: str, opts: tuple[str, ...], want_ptx: bool
) -> tuple[bytes, str | None, str]:
    nvrtc = _nvrtc()
    where = f"kernel {name!r} for {arch}"
    err, supported = nvrtc.nvrtcGetSupportedArchs()
    match = _ARCH_RE.fullmatch(arch)
    assert match is not None
    if err == nvrtc.nvrtcResult.NVRTC_SUCCESS and int(match.group(1)) not in supported:
        major, minor = nvrtc_version()
        listed = ", ".join(f"sm_{a}" for a in supported)
        raise CompileError(
            f"cannot compile {where}: NVRTC {major}.{minor} does not support {arch} "
            f"(it supports {listed})"
        )
    _, prog = _check(
        nvrtc,
        nvrtc.nvrtcCreateProgram(
            source.encode("utf-8", "surrogatepass"), f"{name}.cu".encode(), 0, [], []
        ),
        "nvrtcCreateProgram",
    )
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        log = _program_log(nvrtc, prog)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(
                f"NVRTC failed to compile {where} ({_err_name(result)}, options: {' '.join(opts)})",
                log=log,
            )
        _, size = _check(nvrtc, nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        ptx: str | None = None
        if want_ptx:
            _, size = _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            buf = bytearray(size)
            _check(nvrtc, nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            ptx = bytes(buf).rstrip(b"\0").decode("utf-8")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    cubin_b = bytes(cubin)
    _check_entry(cubin_b, name, arch, log)
    return cubin_b, ptx, log


# ELF: st_other bit marking a CUDA kernel entry point (STO_CUDA_ENTRY).
_STO_CUDA_ENTRY = 0x10
_STT_FUNC = 2


def _elf_functions(cubin: bytes) -> dict[str, bool] | None:
    """Function symbols of a 64-bit little-endian cubin: name -> is a kernel
    entry; None when ``cubin`` is not such an ELF file."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        return None
    e_shoff = int.from_bytes(cubin[0x28:0x30], "little")
    e_shentsize = int.from_bytes(cubin[0x3A:0x3C], "little")
    e_shnum = int.from_bytes(cubin[0x3C:0x3E], "little")
    sections = []
    for i in range(e_shnum):
        off = e_shoff + i * e_shentsize
        _name, sh_type, _flags, _addr, sh_offset, sh_size, sh_link, _info, _align, sh_entsize = (
            struct.unpack_from("<IIQQQQIIQQ", cubin, off)
        )
        sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))
    funcs: dict[str, bool] = {}
    for sh_type, offset, size, link, entsize in sections:
        if sh_type != 2 or entsize < 24:  # SHT_SYMTAB
            continue
        str_off = sections[link][1]
        for pos in range(offset, offset + size, entsize):
            st_name, st_info, st_other = struct.unpack_from("<IBB", cubin, pos)
            if st_info & 0xF != _STT_FUNC:
                continue
            end = cubin.index(b"\0", str_off + st_name)
            sym = cubin[str_off + st_name : end].decode("utf-8", "replace")
            funcs[sym] = bool(st_other & _STO_CUDA_ENTRY)
    return funcs


def _check_entry(cubin: bytes, name: str, arch: str, log: str) -> None:
    try:
        funcs = _elf_functions(cubin)
    except (struct.error, ValueError, IndexError):
        return  # not an ELF layout this reader knows: leave the check to the loader
    if funcs is None:
        return
    if funcs.get(name):
        return
    kernels = sorted(n for n, entry in funcs.items() if entry)
    if name in funcs:
        why = "it is a __device__ function, not a __global__ kernel"
    elif any(k.startswith(f"_Z{len(name)}{name}") for k in kernels):
        why = 'it is C++-mangled; declare it extern "C"'
    else:
        why = 'no such extern "C" __global__ function'
    found = ", ".join(kernels) if kernels else "none"
    raise CompileError(
        f"kernel {name!r} not found in the code compiled for {arch}: {why} "
        f"(kernels found: {found})",
        log=log,
    )


# --------------------------------------------------------------------------- compile_cuda

_memory: dict[tuple[Any, ...], CompiledModule] = {}
_inflight: dict[tuple[Any, ...], threading.Lock] = {}
_memory_lock = threading.Lock()
_warned_dirs: set[str] = set()


def clear_memory_cache() -> None:
    """Forget every in-process cache entry (the on-disk cache is untouched)."""
    with _memory_lock:
        _memory.clear()


def compile_cuda(
    source: str,
    name: str,
    *,
    arch: str,
    options: str | Sequence[str] = (),
    want_ptx: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
) -> CompiledModule:
    """Compile CUDA C++ ``source`` to a cubin for ``arch`` and check that it
    holds the ``extern "C"`` kernel ``name``.

    ``options`` are NVRTC command-line flags, a string (split like a shell
    does) or a sequence, e.g. ``"--use_fast_math -std=c++17 -DN=4 -lineinfo"``.
    ``-arch=<arch>`` is always added; a flag naming another architecture raises
    ``ValueError``. ``-O0``..``-O3`` go to ptxas (NVRTC itself has no ``-O``).
    ``want_ptx`` also returns the PTX of the same compilation. The on-disk entry
    keeps the PTX either way, so a later ``want_ptx`` call is a hit too.

    Cached in-process and in ``cache_dir`` (default ``default_cache_dir()``);
    ``use_cache=False`` neither reads nor writes either cache. A hit makes no
    NVRTC call. A miss calls ``nvrtcCreateProgram`` / ``nvrtcCompileProgram`` /
    ``nvrtcGetCUBIN`` / ``nvrtcGetPTX`` / ``nvrtcGetProgramLog`` and blocks the
    calling thread for the compile (typically 30 ms to seconds; the GIL is
    released meanwhile). Thread-safe: concurrent calls for the same kernel
    compile it once; asyncgpu does not serialize different kernels (NVRTC may
    run them one at a time internally). The in-process cache is shared
    by all ``cache_dir`` values.

    Raises ``CompileError`` (with NVRTC's full log in ``.log``) when the code
    does not compile, the kernel is missing, or NVRTC is not installed.
    """
    if use_cache:
        try:
            options_key = options if isinstance(options, str) else tuple(options)
            hit = _memory.get((source, name, options_key, arch, want_ptx))
        except TypeError:  # unhashable options: the checks below say what is wrong
            hit = None
        if hit is not None:
            return hit

    if not isinstance(source, str):
        raise TypeError(f"source must be a str, not {type(source).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError('name must be a non-empty str (the extern "C" kernel name)')
    if not isinstance(arch, str) or not _ARCH_RE.fullmatch(arch):
        raise ValueError(f"arch must look like 'sm_90' (a real architecture), got {arch!r}")
    opts = _final_options(options, arch)
    deps = _include_digest(source, opts) if use_cache else None
    if deps is None:  # (not cached: asked for, or its includes cannot be followed)
        cubin, ptx, log = _nvrtc_compile(source, name, arch, opts, want_ptx)
        return CompiledModule(name, arch, cubin, ptx, log, cache_hit=False)

    # A source with includes is never stored under the call's own arguments (the
    # lookup at the top), only with what it includes.
    full_key: tuple[Any, ...] = (source, name, options_key, arch, want_ptx)
    if deps:
        full_key += (deps,)
    with _memory_lock:
        key_lock = _inflight.setdefault(full_key, threading.Lock())
    with key_lock:
        try:
            hit = _memory.get(full_key)
            if hit is not None:
                return hit
            directory = os.fspath(cache_dir) if cache_dir is not None else _default_cache_dir()
            entry = _disk_lookup(directory, source, name, opts, arch, want_ptx, deps)
            if entry is not None:
                module = CompiledModule(name, arch, *entry, cache_hit=True)
                with _memory_lock:
                    _memory[full_key] = module
                return module

            # The entry always keeps the PTX: a later ``want_ptx`` lookup of the same
            # kernel (``compile_function`` reads the signature from it) then hits too.
            cubin, ptx, log = _nvrtc_compile(source, name, arch, opts, True)
            module = CompiledModule(name, arch, cubin, ptx if want_ptx else None, log, False)
            key = _disk_key(source, name, opts, arch, _file_tag() or _version_tag(), deps)
            written = _trusted(directory) and _atomic_write(
                _entry_path(directory, key), _pack_entry(key, cubin, ptx, log)
            )
            if not written and directory not in _warned_dirs and directory not in _untrusted_dirs:
                _warned_dirs.add(directory)
                import warnings

                warnings.warn(
                    f"asyncgpu: cannot write the kernel cache in {directory}; compiled "
                    "kernels are cached in this process only (set ASYNCGPU_CACHE_DIR)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            with _memory_lock:
                _memory[full_key] = replace(module, cache_hit=True)
            return module
        finally:
            with _memory_lock:
                if _inflight.get(full_key) is key_lock:
                    del _inflight[full_key]


# --------------------------------------------------------------------------- dumps


def dump_sass(cubin: bytes) -> str | None:
    """Disassemble ``cubin`` to SASS with ``cuobjdump --dump-sass`` or, failing
    that, ``nvdisasm``, whichever is on ``PATH`` (or in an NVIDIA wheel that
    ``cuda.pathfinder`` finds). None when neither is available or both fail.

    Runs the tool as a subprocess and blocks the calling thread until it exits."""
    import shutil
    import subprocess
    import tempfile

    def locate(tool: str) -> str | None:
        found = shutil.which(tool)
        if found is None:
            try:
                from cuda.pathfinder import find_nvidia_binary_utility

                found = find_nvidia_binary_utility(tool)
            except Exception:
                found = None
        return found

    commands: list[list[str]] = []
    cuobjdump = locate("cuobjdump")
    if cuobjdump:
        commands.append([cuobjdump, "--dump-sass"])
    nvdisasm = locate("nvdisasm")
    if nvdisasm:
        commands.append([nvdisasm])
    if not commands:
        return None
    with tempfile.TemporaryDirectory(prefix="asyncgpu-sass-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        for command in commands:
            try:
                done = subprocess.run(
                    [*command, path], capture_output=True, text=True, timeout=120, check=False
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout
    return None


def write_dump(
    text: str,
    target: bool | str | os.PathLike[str] | Callable[[], str | os.PathLike[str]] | None,
    suffix: str,
    *,
    name: str | None = None,
) -> str | None:
    """Carry out a ``dump_asm=`` / ``_dump_sass=`` request for ``text``.

    ``False``/``None``: nothing, returns None. ``True``: returns ``text``
    itself. A path (``str`` or ``os.PathLike``, or a callable returning one):
    writes ``text`` there and returns the path as ``str``; a ``%`` in a ``str``
    path is replaced by ``name``, and an existing directory receives
    ``<name><suffix>`` (``kernel<suffix>`` without a name). Parent directories
    are created. Plain file I/O, blocking the calling thread."""
    if target is None or target is False:
        return None
    if target is True:
        return text
    if callable(target):
        target = target()
    if not isinstance(target, (str, os.PathLike)):
        raise TypeError(f"dump target must be a bool or a path, not {type(target).__name__}")
    path = os.fspath(target)
    if isinstance(target, str) and name is not None:
        path = path.replace("%", name)
    if os.path.isdir(path):
        path = os.path.join(path, f"{name or 'kernel'}{suffix}")
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
