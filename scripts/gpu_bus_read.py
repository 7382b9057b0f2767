"""How fast this card's SMs read page-locked host memory over the bus (zero-copy), against its DMA upload rate.

A decode step fetches the experts no card holds from the arena this way (lane/kernels/fetch.cu, one stream of
16-byte words on half the SMs), and `stratad bench --scenario experts --cases bus1,bus2,bus8` times the expert
kernels reading them in place. This probe says what the bus allows a plain reader: every thread reads 16-byte
words, `depth` loads in flight at a time, by plain loads (ld.global.nc) or by cp.async into shared memory (the
expert kernels' staging), on grids from a quarter of the SMs to four blocks an SM, and (sm_90) by bulk copies of
4-16 KB (TMA); each result in GB/s and as a
fraction of the upload rate (host -> device DMA, the copy engine).

--memory says where the host bytes live, each registered as the lanes register theirs (cudaHostRegister, mapped):
a pinned allocation (cudaHostAlloc), a file's page cache (the engine bench's arena is the model file's mapping),
anonymous memory in 4 KB pages or with transparent huge pages asked for, and /dev/shm (the daemon's arena): whether
the pages' size and place change what the bus gives. --shapes fetch: only fetch.cu's shape and the best one.

    python3 scripts/gpu_bus_read.py [--mib 256] [--memory pinned,file,anon,anon-huge,shm] [--shapes all|fetch]
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOURCE = r"""
extern "C" __global__ void read_ld(const uint4* __restrict__ src, long long n16, int depth, unsigned* out) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += stride * depth) {
        uint4 v[8];
#pragma unroll
        for (int d = 0; d < 8; ++d)
            if (d < depth && i + d * stride < n16) v[d] = __ldg(src + i + d * stride);
#pragma unroll
        for (int d = 0; d < 8; ++d)
            if (d < depth && i + d * stride < n16) acc ^= v[d].x ^ v[d].y ^ v[d].z ^ v[d].w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads
}

extern "C" __global__ void read_cp_async(const uint4* __restrict__ src, long long n16, int depth, unsigned* out) {
    extern __shared__ uint4 buf[];  // depth x blockDim.x words
    const long long stride = (long long)gridDim.x * blockDim.x;
    unsigned acc = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += stride * depth) {
        for (int d = 0; d < depth; ++d) {
            if (i + d * stride < n16) {
                const unsigned dst = (unsigned)__cvta_generic_to_shared(buf + d * blockDim.x + threadIdx.x);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src + i + d * stride));
            }
        }
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
        for (int d = 0; d < depth; ++d)
            if (i + d * stride < n16) acc ^= buf[d * blockDim.x + threadIdx.x].x;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

// Hopper's bulk copies (TMA, one thread a block issues them): `depth` chunks of `chunk` bytes in flight a block,
// each landing in shared memory on the block's mbarrier. Whether larger requests cross the bus faster.
extern "C" __global__ void read_bulk(const unsigned char* __restrict__ src, long long nbytes, int chunk, int depth,
                                     unsigned* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char bulk[];  // depth x chunk bytes
    __shared__ __align__(8) unsigned long long bar;
    const unsigned sbar = (unsigned)__cvta_generic_to_shared(&bar);
    if (threadIdx.x == 0) asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(sbar) : "memory");
    __syncthreads();
    unsigned phase = 0, acc = 0;
    const long long n = nbytes / chunk;
    for (long long c0 = (long long)blockIdx.x * depth; c0 < n; c0 += (long long)gridDim.x * depth) {
        const int cnt = (int)(n - c0 < depth ? n - c0 : depth);
        if (threadIdx.x == 0) {
            asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(sbar), "r"(cnt * chunk) : "memory");
            for (int d = 0; d < cnt; ++d) {
                const unsigned dst = (unsigned)__cvta_generic_to_shared(bulk + d * chunk);
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                             :: "r"(dst), "l"(src + (c0 + d) * chunk), "r"(chunk), "r"(sbar) : "memory");
            }
        }
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(sbar), "r"(phase) : "memory");
        phase ^= 1u;
        acc ^= bulk[threadIdx.x];
        __syncthreads();  // every thread past the wait before the next copies land in the buffer
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
#endif
}
"""

# (kind, threads, blocks an SM, depth, chunk bytes or 0): the shapes each kernel is timed at; under one block an SM,
# part of the SMs (fetch.cu runs on half)
SHAPES = [(kind, t, b, d, 0) for kind in ("read_ld", "read_cp_async") for t in (256, 512)
          for b in (0.25, 0.5, 1, 2, 4) for d in (1, 2, 4, 8)
          if kind == "read_ld" or d * t * 16 <= 48 * 1024] + \
         [("read_bulk", 128, b, d, c) for b in (0.5, 1, 2) for d in (1, 2) for c in (4096, 16384)]


FETCH_SHAPES = [("read_ld", 512, 0.5, 4, 0), ("read_ld", 512, 2, 8, 0)]  # fetch.cu's, and the best of session 28
MEMORY = ("pinned", "file", "anon", "anon-huge", "shm")


def host_memory(cp, kind: str, nbytes: int, keep: list) -> int:
    """A pointer to nbytes of host memory of this kind, page-locked and mapped; keep holds its owners (unregister()
    before dropping them)."""
    import mmap
    import os
    import tempfile

    import numpy as np

    if kind == "pinned":
        mem = cp.cuda.alloc_pinned_memory(nbytes)
        keep.append(mem)
        view = np.frombuffer(mem, np.uint8, nbytes)
    else:
        if kind in ("file", "shm"):
            fd, path = tempfile.mkstemp(dir="/dev/shm" if kind == "shm" else os.environ.get("BUS_DIR", "/tmp"))
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
            os.close(fd)
            os.unlink(path)
        else:
            mm = mmap.mmap(-1, nbytes)
            mm.madvise(mmap.MADV_HUGEPAGE if kind == "anon-huge" else mmap.MADV_NOHUGEPAGE)
        view = np.frombuffer(mm, np.uint8, nbytes)
        keep.append((mm, view))
    view[:] = np.arange(nbytes, dtype=np.uint64).astype(np.uint8)  # every page present before it is locked
    if kind != "pinned":
        cp.cuda.runtime.hostRegister(view.ctypes.data, nbytes, 2 | 8)  # mapped, read-only: as lane/host_lock.py
    return view.ctypes.data


def huge_kb() -> dict:
    """/proc/meminfo's huge-page lines (kB): whether the kernel gave this memory 2 MB pages."""
    lines = Path("/proc/meminfo").read_text().splitlines()
    return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in lines) if "Huge" in k and "kB" in v}


def upload_rate(cp, ptr: int, nbytes: int, iters: int = 4) -> float:
    """Host -> device DMA from this memory, GB/s (best of iters)."""
    dev = cp.empty(nbytes, cp.uint8)
    e0, e1, best = cp.cuda.Event(), cp.cuda.Event(), 0.0
    for _ in range(iters):
        e0.record()
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, ptr, nbytes, 1, cp.cuda.get_current_stream().ptr)
        e1.record()
        e1.synchronize()
        best = max(best, nbytes / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3) / 1e9)
    return best


def main() -> int:
    import cupy as cp
    import numpy as np

    from stratad.bench.hardware import gpu_info, gpu_upload_bandwidth

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--memory", default="pinned", help=f"comma-separated, of {', '.join(MEMORY)}")
    ap.add_argument("--shapes", choices=("all", "fetch"), default="all")
    ap.add_argument("--json")
    a = ap.parse_args()
    nbytes = a.mib << 20
    upload = gpu_upload_bandwidth(cp, nbytes)[0]
    mod = cp.RawModule(code=SOURCE, options=("-std=c++17",))
    out = cp.zeros(1, cp.uint32)
    n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
    results = []
    for memory in a.memory.split(","):
        if memory not in MEMORY:
            ap.error(f"--memory: {memory!r} is not one of {', '.join(MEMORY)}")
        keep: list = []
        src = host_memory(cp, memory, nbytes, keep)  # a page-locked pointer is a device pointer as it is (UVA)
        r = {"memory": memory, "kind": "dma", "GBps": round(upload_rate(cp, src, nbytes), 1), "meminfo": huge_kb()}
        r["frac_upload"] = round(r["GBps"] / upload, 3)
        results.append(r)
        print(json.dumps(r), flush=True)
        results += read_rates(cp, mod, np.uint64(src), nbytes, out, n_sm, memory, upload,
                              SHAPES if a.shapes == "all" else FETCH_SHAPES)
        if memory != "pinned":  # before the mapping goes
            cp.cuda.runtime.hostUnregister(src)
        del keep
    best = max((r for r in results if r["kind"] != "dma"), key=lambda r: r["GBps"])
    doc = {"probe": "zero-copy reads of page-locked host memory by the SMs", "bytes": nbytes,
           "upload_GBps": round(upload, 1), "hardware": gpu_info(cp), "best": best, "results": results}
    print(f"upload (DMA) {upload:.1f} GB/s; best SM read {best['GBps']} GB/s ({best['memory']}, {best['kind']}, "
          f"{best['threads']} threads x {best['blocks_per_sm']} blocks an SM, {best['depth']} loads in flight)")
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


def read_rates(cp, mod, src, nbytes: int, out, n_sm: int, memory: str, upload: float, shapes) -> list[dict]:
    """Each shape's zero-copy read rate of the bytes at src."""
    import numpy as np

    results = []
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    for kind, threads, blocks_per_sm, depth, chunk in shapes:
        if kind == "read_bulk" and int(cp.cuda.Device().compute_capability) < 90:
            continue
        k = mod.get_function(kind)
        smem = depth * (chunk or threads * 16) if kind != "read_ld" else 0
        args = (src, np.int64(nbytes), np.int32(chunk), np.int32(depth), out) if chunk else \
            (src, np.int64(nbytes // 16), np.int32(depth), out)
        grid = (max(1, int(n_sm * blocks_per_sm)),)
        k(grid, (threads,), args, shared_mem=smem)
        e0.record()
        for _ in range(3):
            k(grid, (threads,), args, shared_mem=smem)
        e1.record()
        e1.synchronize()
        gbs = 3 * nbytes / (cp.cuda.get_elapsed_time(e0, e1) * 1e-3) / 1e9
        r = {"memory": memory, "kind": kind, "threads": threads, "blocks_per_sm": blocks_per_sm, "depth": depth,
             "chunk": chunk, "GBps": round(gbs, 1), "frac_upload": round(gbs / upload, 3)}
        results.append(r)
        print(json.dumps(r), flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
