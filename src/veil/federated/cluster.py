"""A trial federation on one machine: a real SuperLink and SuperNodes as processes on 127.0.0.1.

What the deployment runbook (docs/federated.md) does on three machines, here with free ports and
one process group per component, for tests and for trying the runbook locally:

    with LocalCluster(tmp, tls=certs) as c:
        c.superlink()
        for i in range(3):
            c.supernode(f'partition-id={i} data-path="{silos}/silo{i}"')
        rc = c.submit(app_dir, {"config": ..., "run-dir": ...})

Every process is started in its own session and killed (its whole group) on exit, so a test leaves
nothing running (`alive()` lists what is left). `submit` runs `flwr run --stream` and returns
non-zero when the ServerApp did not finish (RUN_DIR/status.json), which `flwr run` itself does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_DEDUP_LOGS": "0",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Certs:
    """The files `scripts/deploy/make_certs.sh` writes: a CA, the SuperLink's TLS pair, SuperNode keys."""

    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"

    def node_key(self, i: int) -> Path:
        return self.folder / f"node{i}"


@dataclass
class LocalCluster:
    root: Path
    certs: Certs | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    port: int = 0

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.home = self.root / "flwr-home"
        self.home.mkdir(exist_ok=True)
        self.env = {**os.environ, **ENV, "FLWR_HOME": str(self.home)}
        self.port = self.port or free_port()

    # ---- processes -------------------------------------------------------------------------------
    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = (self.root / f"{name}.log").open("ab")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        self.procs[name] = p
        return p

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill a component's whole process group (a SuperNode with its worker and ClientApps)."""
        p = self.procs.pop(name, None)
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(20)

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)
        for pid in self.alive():  # anything that escaped its group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def alive(self) -> list[int]:
        """Pids of processes still running that name this cluster's folder or port (orphans)."""
        out = []
        marks = (str(self.root).encode(), f"127.0.0.1:{self.port}".encode())
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                cmd = (d / "cmdline").read_bytes()
                environ = (d / "environ").read_bytes()
            except OSError:
                continue
            if any(m in cmd for m in marks) or str(self.home).encode() in environ:
                out.append(int(d.name))
        return out

    # ---- components --------------------------------------------------------------------------------
    def tls_args(self) -> list[str]:
        return ["--insecure"] if self.certs is None else ["--root-certificates", str(self.certs.ca)]

    def superlink(self, database: Path | None = None) -> subprocess.Popen:
        cmd = ["flower-superlink", "--host", "127.0.0.1", "--port", str(self.port)]
        if self.certs is None:
            cmd.append("--insecure")
        else:
            f = self.certs.folder
            cmd += ["--ssl-ca-certfile", str(f / "ca.crt"), "--ssl-certfile", str(f / "server.pem")]
            cmd += ["--ssl-keyfile", str(f / "server.key"), "--enable-supernode-auth"]
        if database is not None:
            cmd += ["--database", str(database)]
        p = self.start("superlink", cmd)
        self.wait_port(self.port)
        self.write_connection()
        return p

    def supernode(self, i: int, node_config: str, tap: Path | None = None) -> subprocess.Popen:
        args = ["--superlink", f"127.0.0.1:{self.port}", "--host", "127.0.0.1", "--port", str(free_port())]
        args += self.tls_args() + ["--node-config", node_config, "--max-wait-time", "120"]
        if self.certs is not None:
            args += ["--auth-supernode-private-key", str(self.certs.node_key(i))]
        cmd = [sys.executable, "-m", "veil.federated.supernode"]
        cmd += ["--tap", str(tap)] if tap is not None else []
        return self.start(f"supernode{i}", [*cmd, "--", *args])

    def register(self, i: int) -> None:
        """Node authentication: tell the SuperLink the public key of SuperNode `i`."""
        assert self.certs is not None
        self.flwr(["supernode", "register", str(self.certs.node_key(i)) + ".pub", "veil-trial"])

    def write_connection(self) -> None:
        """$FLWR_HOME/config.toml: the `veil-trial` connection `flwr run` / `flwr supernode` use."""
        lines = ["[superlink]", 'default = "veil-trial"', "", "[superlink.veil-trial]"]
        lines.append(f'address = "127.0.0.1:{self.port}"')
        if self.certs is None:
            lines.append("insecure = true")
        else:
            lines.append(f'root-certificates = "{self.certs.ca}"')
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")

    def flwr(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["flwr", *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.root
        )

    def start_run(self, app: Path, run_config: dict[str, Any], name: str = "flwr-run") -> subprocess.Popen:
        """`flwr run APP veil-trial --stream --run-config ...` in the background (log: NAME.log)."""
        rc_args = " ".join(f"{k}={json.dumps(v)}" for k, v in run_config.items())
        cmd = ["flwr", "run", str(app), "veil-trial", "--stream", "--run-config", rc_args]
        (self.root / f"{name}.log").open("ab").write(("$ " + shlex.join(cmd) + "\n").encode())
        return self.start(name, cmd)

    def submit(self, app: Path, run_config: dict[str, Any], timeout: float = 900) -> int:
        """Run to the end; non-zero unless `flwr run` exited 0 and RUN_DIR/status.json says finished."""
        p = self.start_run(app, run_config)
        try:
            code = p.wait(timeout)
        finally:
            self.procs.pop("flwr-run", None)
        return code or run_status(Path(run_config["run-dir"]))

    def wait_port(self, port: int, timeout: float = 60) -> None:
        end = time.time() + timeout
        while time.time() < end:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f} s; see {self.root}/*.log")


def run_status(run_dir: Path) -> int:
    """0 when the ServerApp wrote status `finished`, else 1 (failed, killed, or never started)."""
    path = run_dir / "status.json"
    if not path.is_file():
        return 1
    return 0 if json.loads(path.read_text()).get("status") == "finished" else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m veil.federated.cluster status RUN_DIR`: exit 0 when the run finished, else 1."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "status":
        print("usage: python -m veil.federated.cluster status RUN_DIR", file=sys.stderr)
        return 2
    run = Path(args[1])
    code = run_status(run)
    path = run / "status.json"
    print(path.read_text().strip() if path.is_file() else f"{run}: no status.json (the ServerApp never started)")
    return code


if __name__ == "__main__":
    sys.exit(main())
