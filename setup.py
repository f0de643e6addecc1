"""Build the optional compiled accelerator, tensorplay_p2p._src.engine._accel (the metadata is in setup.cfg)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError, LinkError

PACKAGE = "tensorplay_p2p"
ENGINE = "tensorplay_p2p._src.engine"  # the engine's folder: the extension and buildinfo.py go here
ENGINE_DIR = ENGINE.replace(".", "/")
VERSION_MACROS = (("I_MPI_VERSION", "Intel MPI"), ("MVAPICH2_VERSION", "MVAPICH2"), ("MVAPICH_VERSION", "MVAPICH"))
RPATH_FLAGS = ("-Wl,-rpath,", "-Wl,-rpath=", "-Wl,-R", "-Wl,--enable-new-dtags", "-Wl,--disable-new-dtags")


class NotBuiltError(Exception):
    """Why the accelerator is not built (a reason for buildinfo.REASON, not an install failure)."""


def find_wrapper() -> list[str]:
    """The MPI compiler wrapper: $MPICC if set, else mpicc on PATH."""
    given = os.environ.get("MPICC", "").strip()
    command = shlex.split(given) if given else ["mpicc"]
    if shutil.which(command[0]) is None:
        raise NotBuiltError(f"MPICC={given!r} was not found" if given else "no MPI compiler wrapper found: set MPICC")
    return command


def wrapper_env() -> dict[str, str]:
    """The environment for the wrapper: $CC, when set, is the C compiler it runs (MPICH, Open MPI, Intel MPI)."""
    env = dict(os.environ)
    if env.get("CC"):
        env.update(MPICH_CC=env["CC"], OMPI_CC=env["CC"], I_MPI_CC=env["CC"])
    return env


def run_wrapper(wrapper: list[str], *args: str) -> subprocess.CompletedProcess[str] | None:
    """The wrapper run with these arguments (None if it could not be started)."""
    try:
        return subprocess.run([*wrapper, *args], capture_output=True, text=True, env=wrapper_env(), timeout=120)
    except (OSError, subprocess.SubprocessError):
        return None


def compile_command(wrapper: list[str]) -> tuple[list[str], list[str]]:
    """The C compiler the wrapper runs and its flags (`-show`: MPICH, Intel MPI, MVAPICH; `--showme`: Open MPI)."""
    for option in ("-show", "--showme"):
        done = run_wrapper(wrapper, option)
        shown = shlex.split(done.stdout) if done and done.returncode == 0 else []
        if shown and not shown[0].startswith("-"):
            n = next((i for i, arg in enumerate(shown) if arg.startswith("-")), len(shown))
            return shown[:n], shown[n:]  # the program may be more than one word (`ccache gcc`)
    return wrapper, []  # a wrapper that cannot show its command (e.g. Cray's cc) compiles and links itself


def strip_rpath(args: list[str]) -> list[str]:
    """The arguments without run-time search paths: libmpi is found by its soname, already loaded by mpi4py."""
    kept, pair = [], False
    for arg in args:
        if pair:
            pair = False  # the DIR of `-Wl,-rpath -Wl,DIR`
        elif arg in ("-Wl,-rpath", "-Wl,-R"):
            pair = True
        elif not arg.startswith(RPATH_FLAGS):
            kept.append(arg)
    return kept


def mpi_macros(wrapper: list[str], scratch: str) -> dict[str, str]:
    """The macros that mpi.h defines, from the wrapper's preprocessor."""
    os.makedirs(scratch, exist_ok=True)
    probe = os.path.join(scratch, "mpi_probe.c")
    with open(probe, "w", encoding="utf-8") as file:
        file.write("#include <mpi.h>\n")
    done = run_wrapper(wrapper, "-E", "-dM", probe)
    if done is None or done.returncode != 0:
        compiler = f"the C compiler (CC={os.environ['CC']})" if os.environ.get("CC") else "the C compiler"
        name = os.path.basename(wrapper[0])
        said = done.stderr.strip().splitlines()[-1] if done and done.stderr.strip() else ""
        said = said.replace(shutil.which(wrapper[0]) or wrapper[0], name)  # no temporary build paths
        raise NotBuiltError(f"{compiler} failed on <mpi.h> through {name}{': ' + said if said else ''}")
    macros = {}
    for line in done.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[0] == "#define":
            macros[parts[1]] = parts[2].strip('"')
    return macros


def mpi_abi(macros: dict[str, str]) -> str:
    """The MPI ABI of mpi.h, as _accel.c decides it."""
    return "openmpi" if "OMPI_MAJOR_VERSION" in macros else "mpich" if "MPICH_VERSION" in macros else "unknown"


def mpi_library(macros: dict[str, str]) -> str:
    """The MPI library and version that mpi.h belongs to, e.g. 'MPICH 5.0.2'."""
    if "OMPI_MAJOR_VERSION" in macros:
        return "Open MPI " + ".".join(macros.get(f"OMPI_{p}_VERSION", "?") for p in ("MAJOR", "MINOR", "RELEASE"))
    for macro, name in VERSION_MACROS:  # before MPICH_VERSION: these MPICH derivatives define it too
        if macro in macros:
            return f"{name} {macros[macro]}"
    return f"MPICH {macros['MPICH_VERSION']}" if "MPICH_VERSION" in macros else "unknown"


def use_command(executable: list[str], command: list[str]) -> list[str]:
    """A setuptools compiler executable with its program replaced by ``command``, run-time search paths removed."""
    flags = executable[1:]
    while flags and not flags[0].startswith("-"):
        flags = flags[1:]  # the rest of a program like `ccache gcc`
    return strip_rpath([*command, *flags])


def describe(exc: Exception) -> str:
    """Why the build failed, in one line (the compiler's own messages are in the build log)."""
    if isinstance(exc, CompileError):
        return f"compile error in {ENGINE_DIR}/_accel.c"
    if isinstance(exc, LinkError):
        return f"link error for {ENGINE}._accel"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def literal(value: str | None) -> str:
    """A Python literal for a string or None, in double quotes (as ruff format writes it)."""
    return "None" if value is None else '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class BuildAccel(build_ext):
    """build_ext that builds the accelerator when it can, warns when it cannot, and writes buildinfo.py."""

    def finalize_options(self) -> None:
        """Always rebuild: the MPI it is built against is not a file that setuptools tracks."""
        super().finalize_options()
        self.force = True

    def run(self) -> None:
        """Build; on any failure remove what was built, warn in one line, and go on without the accelerator."""
        self.info: dict[str, str | None] = {"ABI": None, "MPI_LIBRARY": None, "COMPILER": None, "REASON": None}
        inplace = self.inplace
        try:
            super().run()
        except Exception as exc:
            self.inplace = inplace  # setuptools clears it while it builds
            self.info.update(ABI=None, REASON=describe(exc))
            for path in self.built_paths():
                if os.path.exists(path):
                    os.remove(path)
            print(
                f"{PACKAGE}: the compiled accelerator was not built ({self.info['REASON']}); "
                "the pure-Python engine will be used",
                file=sys.stderr,
                flush=True,
            )
        self.write_buildinfo()

    def build_extensions(self) -> None:
        """Compile and link with the MPI wrapper's command and flags (the C compiler being $CC when set)."""
        wrapper = find_wrapper()
        self.info["COMPILER"] = os.path.basename(wrapper[0])
        try:
            import mpi4py
        except ImportError:
            raise NotBuiltError("mpi4py is not installed in the build environment") from None
        macros = mpi_macros(wrapper, self.build_temp)
        program, flags = compile_command(wrapper)
        links = [flag for flag in flags if flag.startswith(("-L", "-l", "-Wl,")) or flag == "-pthread"]
        compiles = [flag for flag in flags if flag not in links or flag == "-pthread"]
        self.compiler.set_executables(
            compiler_so=use_command(self.compiler.compiler_so, [*program, *compiles, "-I" + mpi4py.get_include()]),
            linker_so=use_command(self.compiler.linker_so, program),
        )
        for ext in self.extensions:  # after the objects; libmpi stays NEEDED even if no symbol of it is used yet
            ext.extra_link_args = ["-Wl,--no-as-needed", *strip_rpath(links)] if links else []
        super().build_extensions()
        self.info.update(ABI=mpi_abi(macros), MPI_LIBRARY=mpi_library(macros))

    def built_paths(self) -> list[str]:
        """The extension's files, in the build directory and (in place) in the source tree."""
        names = [self.get_ext_filename(self.get_ext_fullname(ext.name)) for ext in self.extensions]
        paths = [os.path.join(self.build_lib, name) for name in names]
        return paths + [self.get_ext_fullpath(ext.name) for ext in self.extensions] if self.inplace else paths

    def buildinfo_paths(self) -> list[str]:
        """Where buildinfo.py goes: the build directory, and the source tree for an in-place build."""
        paths = [os.path.join(self.build_lib, ENGINE_DIR, "buildinfo.py")]
        if self.inplace:
            source = self.get_finalized_command("build_py").get_package_dir(ENGINE)
            paths.append(os.path.join(source, "buildinfo.py"))
        return paths

    def write_buildinfo(self) -> None:
        """Record the build's outcome for the engine's selection (tensorplay_p2p._src.engine)."""
        lines = [
            '"""How the compiled accelerator was built: written by setup.py at install (not in version control)."""',
            "",
            *(f"{key}: str | None = {literal(value)}" for key, value in self.info.items()),
        ]
        for path in self.buildinfo_paths():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as file:
                file.write("\n".join(lines) + "\n")

    def get_outputs(self) -> list[str]:
        """The extension (when built) and buildinfo.py."""
        return [*super().get_outputs(), os.path.join(self.build_lib, ENGINE_DIR, "buildinfo.py")]


setup(
    ext_modules=[Extension(f"{ENGINE}._accel", [f"{ENGINE_DIR}/_accel.c"])],
    cmdclass={"build_ext": BuildAccel},
)
