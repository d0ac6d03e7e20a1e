"""The build of asyncgpu's C extension (configured in pyproject.toml), with a
clear message where it cannot be built: asyncgpu needs it."""

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, PlatformError


class BuildExt(build_ext):
    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError) as e:
            raise CompileError(
                "asyncgpu needs a C compiler (gcc or clang) and the Python headers "
                "(python3-dev or python3-devel) to build its extension asyncgpu._native, "
                f"which it cannot run without (no CUDA toolkit is needed). The build failed: {e}"
            ) from e


setup(cmdclass={"build_ext": BuildExt})
