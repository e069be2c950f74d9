"""The default device backend, ``ipumodel``: a simulator of the tile machine.

It loads the package a real device would: every used tile's SRAM is a byte array filled from
its tile image; the tile program and exchange table are decoded from that memory. Host calls run
phase by phase: the exchange copies exactly what the tables say, then every tile's vertices call
the compiled C kernels with pointers into that tile's memory, then a sync. Cycles come from the
kernels' estimators and the exchange horizons, as in the cost model.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

from .. import canonical, hookimpl
from ..device import DeviceRun, device_ownership
from ..errors import UserError
from ..log import log
from ..operators import registry
from ..package import Package
from ..planning import codegen, exchange

DTYPES = {"f32": np.float32, "f16": np.float16, "f143": np.uint8, "f152": np.uint8}


class Simulator:
    name = "ipumodel"

    def run(self, package: bytes, inputs: dict, workdir: Path) -> DeviceRun:
        log.info("reading application package")
        pkg = Package(package, "package")
        m = pkg.manifest
        machine = m["machine"]
        log.info("application package read", tiles=m["tiles"], compiler=pkg.compiler)
        with device_ownership(self.name):
            log.info("opening IPU device", path='"ipumodel:0"')
            log.info("IPU device initialized")
            return self._run(pkg, machine, inputs, workdir)

    def _run(self, pkg, machine, inputs, workdir):
        m = pkg.manifest
        t0 = time.perf_counter()
        log.info("loading application", tile_count=m["tiles"])
        kernels = self._load_kernels(pkg, workdir)
        mems, programs, tables = {}, {}, []
        idle = m["idle_image"]
        for tile, digest in enumerate(m["tile_images"]):
            if digest == idle:
                continue
            header, blobs = pkg.images[digest]
            mem = np.zeros(machine["sram_end"], dtype=np.uint8)
            names = {}
            for kind, name, addr, size, _ in header["segments"]:
                if kind == "kernel":
                    names[name] = kernels[name]
                    continue
                raw = blobs[kind] if kind in ("program", "exchange") else blobs[f"data@{addr}"]
                mem[addr:addr + size] = np.frombuffer(raw, dtype=np.uint8)
                if kind in ("program", "exchange"):
                    names[f"@{kind}"] = (addr, size)
            mems[tile] = mem
            kn, steps = codegen.decode_program(_read(mem, names["@program"]))
            programs[tile] = {s: [(names[kn[k]], kn[k], np.asarray(a, dtype=np.uint32)) for k, a in verts]
                              for s, verts in steps}
            try:
                tables.append(codegen.decode_exchange(_read(mem, names["@exchange"])))
            except ValueError as exc:
                raise UserError("package", f"tile {tile}: {exc}: rebuild the package with this ipubuild") from None
        log.info("application loaded and initial synchronization completed", tile_count=m["tiles"],
                 elapsed_ms=int((time.perf_counter() - t0) * 1000))
        host = pkg.manifest["host"]
        log.info("invoking host exchange call", call='"initialize"', phases=host["initialize"]["phases"])
        for b in m["inputs"]:
            raw = _input_bytes(b, inputs)
            for off, size, tile, addr in b["ranges"]:
                mems[tile][addr:addr + size] = raw[off:off + size]
        log.info("invoking host exchange call", call='"run"', phases=host["run"]["phases"])
        by_step = {}
        for table in tables:
            for e in table:
                by_step.setdefault(e[0], []).append(e[1:])
        host_program = canonical.loads(pkg.member("host/program.json"))
        reg = registry()
        steps, total, ok = [], 0, True
        sync = machine["exchange"]["sync_cycles"]
        for s in range(host["run"]["phases"]):
            step_entries = by_step.get(s, [])
            run_exchange(mems, step_entries)
            horizon = exchange.horizon_of(step_entries, machine, host_program["paired"][s]) if step_entries else 0
            compute = {}
            for tile, prog in programs.items():
                verts = prog.get(s)
                if not verts:
                    continue
                base = mems[tile].ctypes.data_as(ctypes.c_void_p)
                cycles = 0
                for fn, kname, args in verts:
                    if fn(base, args.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32))) != 0:
                        ok = False
                        log.warning("vertex failed", step=s, tile=tile, kernel=kname)
                    cycles += int(reg.kernels[kname].cycles([int(a) for a in args], machine))
                compute[str(tile)] = cycles
            slowest = max(compute.values(), default=0)
            total += horizon + slowest + sync
            steps.append({"name": host_program["steps"][s], "exchange": horizon, "compute": compute,
                          "slowest": slowest, "sync": sync})
        outputs = {}
        for b in m["outputs"]:
            raw = np.zeros(int(np.prod(b["shape"])) * np.dtype(DTYPES[b["dtype"]]).itemsize, np.uint8)
            for off, size, tile, addr in b["ranges"]:
                raw[off:off + size] = mems[tile][addr:addr + size]
            outputs[b["name"]] = raw.view(DTYPES[b["dtype"]]).reshape(b["shape"])
        trace = _trace(steps, machine)
        profile = {"device": self.name, "tiles": m["tiles"], "tiles_used": len(mems), "ok": ok,
                   "total_cycles": total, "samples": len(trace), "steps": steps}
        return DeviceRun(outputs, profile, trace)

    def _load_kernels(self, pkg, workdir):
        out, known = {}, registry().kernels
        for name, digest in sorted(pkg.manifest["kernels"].items()):
            if name not in known:
                raise UserError(f"kernel {name}", "no installed plugin declares this kernel variant: install "
                                "the plugins the package was built with")
            path = Path(workdir) / f"{digest}.so"
            path.write_bytes(pkg.kernel_object(name))
            try:
                fn = ctypes.CDLL(str(path)).ipu_vertex
            except (OSError, AttributeError) as exc:
                raise UserError(f"kernel {name}", f"the device cannot load its object: {exc}") from None
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
            out[name] = fn
        return out


def run_exchange(mems: dict, entries) -> None:
    """Perform one exchange phase: each entry ``[src_tile, src_addr, src_stride, dst_tile,
    dst_addr, dst_stride, rows, row_bytes, (dst_tile, dst_addr, dst_stride)...]`` copies ``rows``
    rows of ``row_bytes`` bytes to each of its destinations (one, or several for a broadcast).
    All reads happen before any write (the exchange is a phase, not a sequence of copies)."""
    staged = []
    for e in entries:
        st, sa, ss, rows, rb = (int(e[i]) for i in (0, 1, 2, 6, 7))
        dests = [(int(e[3]), int(e[4]), int(e[5]))] + [(int(d), int(a), int(s)) for d, a, s in
                                                       zip(e[8::3], e[9::3], e[10::3])]
        for tile, addr, stride in ((st, sa, ss), *dests):
            if tile not in mems or addr + (rows - 1) * stride + rb > len(mems[tile]):
                raise UserError("package", f"exchange entry to or from tile {tile} address {addr} "
                                "is out of range: the package is corrupt")
        src = np.lib.stride_tricks.as_strided(mems[st][sa:], (rows, rb), (ss, 1)).copy()
        staged.extend((dt, da, ds, rows, rb, src) for dt, da, ds in dests)
    for dt, da, ds, rows, rb, data in staged:
        np.lib.stride_tricks.as_strided(mems[dt][da:], (rows, rb), (ds, 1))[...] = data


def _input_bytes(binding: dict, inputs: dict) -> np.ndarray:
    """The bytes of the input a binding names, in the dtype and size the package expects."""
    name = binding["name"]
    if name not in inputs:
        raise UserError("package", f"it binds an input {name} the target does not have")
    raw = np.ascontiguousarray(inputs[name], dtype=DTYPES[binding["dtype"]])
    if raw.size != int(np.prod(binding["shape"])):
        raise UserError("package", f"input {name} has {raw.size} elements, the package expects shape {binding['shape']}")
    return raw.view(np.uint8).reshape(-1)


def _read(mem, where):
    addr, size = where
    return mem[addr:addr + size].tobytes()


def _trace(steps, machine) -> list:
    """Chrome trace events: one track per tile, one slice per compute and exchange phase (µs)."""
    us = 1e6 / machine["clock_hz"]
    events, clock = [], 0
    for s in steps:
        if s["exchange"]:
            events.append({"name": f"exchange {s['name']}", "ph": "X", "pid": 0, "tid": 0,
                           "ts": round(clock * us, 3), "dur": round(s["exchange"] * us, 3)})
        start = clock + s["exchange"]
        for tile, c in sorted(s["compute"].items(), key=lambda kv: int(kv[0])):
            events.append({"name": s["name"], "ph": "X", "pid": 0, "tid": int(tile) + 1,
                           "ts": round(start * us, 3), "dur": round(c * us, 3), "args": {"cycles": c}})
        clock = start + s["slowest"] + s["sync"]
    return events


@hookimpl
def ipubuild_device_backends():
    return {"ipumodel": Simulator}
