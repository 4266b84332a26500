#!/usr/bin/env python3
"""Synthetic multi-rank Kineto (torch.profiler chrome-trace) generator.

Models a distributed Plug-and-Play (PnP) reconstruction job on NVIDIA H100s:
per PnP iteration a `gradient` section (FFT based data-fidelity gradient) and a
`denoiser` section (DRUNet-like conv net), each followed by one NCCL
all_reduce, and a scalar `.item()` (DtoH copy + stream sync) at the end.

Per rank one file `rank<r>.<host>_<pid>.<n>.pt.trace.json[.gz]` with the
Kineto layout (top level schemaVersion, deviceProperties, distributedInfo, ...,
traceEvents), events written one field-group per line like Kineto does.

Events per kernel launch:
  cpu_op chain (e.g. aten::conv2d > aten::convolution > aten::_convolution >
  aten::cudnn_convolution, with record_shapes args), cuda_runtime
  cudaLaunchKernel (correlation, External id, cbid), GPU `kernel` (pid = device,
  tid = stream, full Kineto kernel args), `ac2g` flow start/finish.
NCCL: cpu_op c10d::allreduce_ > cpu_op record_param_comms (comm args) >
  user_annotation nccl:all_reduce > cuda_driver cuLaunchKernelEx; GPU kernel
  ncclDevKernel_AllReduce_Sum_f32_RING_LL(...) on the NCCL stream with comm args,
  plus gpu_user_annotation nccl:all_reduce, cudaEventRecord/cudaStreamWaitEvent.
Sections: CPU user_annotation + gpu_user_annotation `gradient` / `denoiser`.
Steps: CPU user_annotation ProfilerStep#i spanning `--iters-per-step` PnP iters.

Usage (a copy of the generator used for the trace-analysis benchmark, benchmarks/trace_analysis_cost.py):
  python benchmarks/kineto_gen.py --out DIR --ranks W --target-mb 50 [--gz] [--iters-per-step 1] [--seed 0] [--jobs 2] [--corr-base 100001]
  (or --steps N instead of --target-mb)
Prints a JSON summary (bytes, events per rank) on stdout and writes DIR.meta.json (next to DIR).
"""

import argparse
import gzip
import json
import multiprocessing as mp
import os
import random
import sys
import time

# --------------------------------------------------------------------------
# kernel name catalogue (names as they appear in real Kineto traces on H100)
K_NCHW2NHWC = (
    "void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true, "
    "(cudnnKernelDataType_t)2>(cudnn::engines_precompiled::nchw2nhwc_params_t<float>, float const*, float*)"
)
K_NHWC2NCHW = (
    "void cudnn::engines_precompiled::nhwcToNchwKernel<float, float, float, true, false, "
    "(cudnnKernelDataType_t)0>(cudnn::engines_precompiled::nhwc2nchw_params_t<float>, float const*, float*)"
)
K_FPROP = (
    "sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32_warpgroupsize1x1x1_"
    "g1_execute_segment_k_off_kernel__5x_cudnn"
)
K_FPROP_S2 = (
    "sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize64x64x32_warpgroupsize1x1x1_"
    "g1_strided_execute_segment_k_off_kernel__5x_cudnn"
)
K_DGRAD = (
    "sm90_xmma_dgrad_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x64x32_warpgroupsize1x1x1_"
    "g1_strided_execute_segment_k_off_kernel__5x_cudnn"
)
K_RELU = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::launch_clamp_scalar("
    "at::TensorIteratorBase&, c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)::{lambda()#1}::"
    "operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, "
    "at::native::(anonymous namespace)::launch_clamp_scalar(at::TensorIteratorBase&, c10::Scalar, c10::Scalar, "
    "at::native::detail::ClampLimits)::{lambda()#1}::operator()() const::{lambda()#7}::operator()() const::"
    "{lambda(float)#1}, std::array<char*, 2ul>)"
)
K_ADD = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
    "(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)"
)
K_SUB = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>, std::array<char*, 2ul> >"
    "(int, at::native::CUDAFunctorOnSelf_add<float>, std::array<char*, 2ul>)"
)
K_CMUL = (
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
    "c10::complex<float>, c10::complex<float>, c10::complex<float>, at::native::binary_internal::MulFunctor<"
    "c10::complex<float> > > >(at::TensorIteratorBase&, at::native::BinaryFunctor<c10::complex<float>, "
    "c10::complex<float>, c10::complex<float>, at::native::binary_internal::MulFunctor<c10::complex<float> > > "
    "const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<c10::complex<float>, "
    "c10::complex<float>, c10::complex<float>, at::native::binary_internal::MulFunctor<c10::complex<float> > > >"
    "(at::TensorIteratorBase&, at::native::BinaryFunctor<c10::complex<float>, c10::complex<float>, "
    "c10::complex<float>, at::native::binary_internal::MulFunctor<c10::complex<float> > > const&)::{lambda(int)#1})"
)
K_CONJ = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::conj_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#2}::operator()() const::{lambda()#5}::operator()() const::{lambda(c10::complex<float>)#1}, "
    "std::array<char*, 2ul> >(int, at::native::conj_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::"
    "operator()() const::{lambda()#5}::operator()() const::{lambda(c10::complex<float>)#1}, std::array<char*, 2ul>)"
)
K_FFT_V = (
    "void vector_fft<256u, 4u, 16u, 2u, 0u, 2u, 1u, 2u, (padding_t)0, (twiddle_t)0, (loadstore_modifier_t)2, "
    "(layout_t)0, unsigned int, float>(kernel_arguments_t<unsigned int>)"
)
K_FFT_R = (
    "void regular_fft<256u, 4u, 16u, 2u, 0u, (padding_t)1, (twiddle_t)0, (loadstore_modifier_t)2, (layout_t)0, "
    "unsigned int, float>(kernel_arguments_t<unsigned int>)"
)
K_FFT_R2C = (
    "void postprocessing::real_post_process_kernel<float, unsigned int, (loadstore_modifier_t)2>"
    "(postprocessing::real_complex_args<unsigned int>)"
)
K_FFT_C2R = (
    "void preprocessing::real_pre_process_kernel<float, unsigned int, (loadstore_modifier_t)2>"
    "(preprocessing::real_complex_args<unsigned int>)"
)
K_NORM = (
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float>, "
    "unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::NormTwoOps<float, float, float>, "
    "unsigned int, float, 4, 4>)"
)
K_FILL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
    "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"
)
K_CAT = (
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_aligned16_contig<at::native::(anonymous namespace)::"
    "OpaqueType<4u>, unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<4u>*, "
    "at::native::(anonymous namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<4u>, "
    "unsigned int, 64, 64>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned int)"
)
K_PAD = (
    "void at::native::(anonymous namespace)::replication_pad_forward_kernel2d<float>(at::GenericPackedTensorAccessor"
    "<float const, 4ul, at::RestrictPtrTraits, long>, at::GenericPackedTensorAccessor<float, 4ul, at::RestrictPtrTraits, long>, int, int, int, int)"
)
K_NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"

C = 1  # image channels
H = W_IMG = 512


def _shape_args(dims, types, strides, concrete):
    return '"Concrete Inputs": %s, "Input type": %s, "Input Strides": %s, "Input Dims": %s' % (
        json.dumps(concrete),
        json.dumps(types),
        json.dumps(strides),
        json.dumps(dims),
    )


def _contig(d):
    s, acc = [], 1
    for x in reversed(d):
        s.append(acc)
        acc *= x
    return list(reversed(s))


def conv_op(cin, cout, h, stride=1, transpose=False):
    """cpu_op chain + kernels for a (transposed) conv2d; bias=False as in DRUNet."""
    k = 2 if stride == 2 else 3
    x = [1, cin, h, h]
    w = [cin, cout, k, k] if transpose else [cout, cin, k, k]
    dims = [x, w, [], [], [], [], []]
    types = ["float", "float", "", "ScalarList", "ScalarList", "ScalarList", "Int"]
    strides = [_contig(x), _contig(w), [], [], [], [], []]
    pad = 0 if stride == 2 else 1
    conc = ["", "", "", "[%d, %d]" % (stride, stride), "[%d, %d]" % (pad, pad), "[1, 1]", "1"]
    sa = _shape_args(dims, types, strides, conc)
    if transpose:
        chain = [
            "aten::conv_transpose2d",
            "aten::convolution",
            "aten::_convolution",
            "aten::cudnn_convolution_transpose",
        ]
        main = K_DGRAD
    else:
        chain = ["aten::conv2d", "aten::convolution", "aten::_convolution", "aten::cudnn_convolution"]
        main = K_FPROP_S2 if stride == 2 else K_FPROP
    hw = h * h
    flops_us = max(4.0, cin * cout * k * k * hw * 2 / 2.5e7)  # ~25 TFLOP/s effective tf32
    mem_us = max(2.0, (cin + cout) * hw * 4 / 2.0e6)  # ~2 TB/s
    kernels = [
        (K_NCHW2NHWC, mem_us * 0.6, [max(1, hw // 1024), 1, 1], [256, 1, 1], 32, 0),
        (main, flops_us, [max(1, hw // 128), 1, 1], [128, 1, 1], 168, 135168),
        (K_NHWC2NCHW, mem_us * 0.6, [max(1, hw // 1024), 1, 1], [256, 1, 1], 32, 0),
    ]
    return chain, sa, kernels


def ew_op(name, kname, shape, nin=2, scalar=False, dtype="float", fac=1.0):
    dims = [shape] * nin + ([[]] if scalar else [])
    types = [dtype] * nin + (["Scalar"] if scalar else [])
    strides = [_contig(shape)] * nin + ([[]] if scalar else [])
    conc = [""] * nin + (["1"] if scalar else [])
    n = 1
    for x in shape:
        n *= x
    dur = max(2.0, n * 4 * (nin + 1) / 2.5e6) * fac
    return [name], _shape_args(dims, types, strides, conc), [(kname, dur, [max(1, n // 512), 1, 1], [128, 1, 1], 16, 0)]


def fft_op(forward=True):
    x = [1, C, H, W_IMG]
    if forward:
        chain = ["aten::fft_rfft2", "aten::_fft_r2c"]
        kern = [
            (K_FFT_V, 9.0, [256, 1, 1], [256, 1, 1], 56, 16384),
            (K_FFT_R2C, 4.0, [129, 1, 1], [256, 1, 1], 32, 0),
            (K_FFT_R, 11.0, [257, 1, 1], [64, 1, 1], 64, 16384),
        ]
        dims = [x, [], [], [], []]
        types = ["float", "", "ScalarList", "", ""]
        strides = [_contig(x), [], [], [], []]
        conc = ["", "", "[-2, -1]", "", ""]
    else:
        chain = ["aten::fft_irfft2", "aten::_fft_c2r"]
        kern = [
            (K_FFT_R, 11.0, [257, 1, 1], [64, 1, 1], 64, 16384),
            (K_FFT_C2R, 4.0, [129, 1, 1], [256, 1, 1], 32, 0),
            (K_FFT_V, 9.0, [256, 1, 1], [256, 1, 1], 56, 16384),
        ]
        xc = [1, C, H, W_IMG // 2 + 1]
        dims = [xc, [], [], [], []]
        types = ["c10::complex<float>", "", "ScalarList", "", ""]
        strides = [_contig(xc), [], [], [], []]
        conc = ["", "", "[-2, -1]", "", ""]
    return chain, _shape_args(dims, types, strides, conc), kern


def build_gradient_ops():
    """Data-fidelity gradient A^T(Ax - y) with an FFT blur operator, plus step and residual norm."""
    img = [1, C, H, W_IMG]
    spec = [1, C, H, W_IMG // 2 + 1]
    ops = []
    for _ in range(2):  # two operator applications (A, then A^T)
        ops.append(fft_op(True))
        ops.append(ew_op("aten::mul", K_CMUL, spec, dtype="c10::complex<float>"))
        ops.append(fft_op(False))
    ops.insert(3, ew_op("aten::sub", K_SUB, img, scalar=True))
    ops.insert(4, ew_op("aten::conj", K_CONJ, spec, nin=1, dtype="c10::complex<float>"))
    ops.append(ew_op("aten::mul", K_ADD, img, scalar=True))  # tau * grad
    ops.append(ew_op("aten::sub", K_SUB, img, scalar=True))  # x - tau*grad
    ops.append(
        (
            ["aten::linalg_vector_norm"],
            _shape_args(
                [img, [], [], [], []],
                ["float", "Scalar", "", "Scalar", ""],
                [_contig(img), [], [], [], []],
                ["", "2", "", "False", ""],
            ),
            [(K_NORM, 6.0, [64, 1, 1], [512, 1, 1], 32, 16)],
        )
    )
    return ops


def build_denoiser_ops():
    """DRUNet: head, 3 down levels (4 ResBlocks + strided conv), body (4 RB), 3 up levels, tail."""
    ops = []
    ch = [64, 128, 256, 512]
    img = [1, C, H, W_IMG]
    ops.append(ew_op("aten::fill_", K_FILL, [1, 1, H, W_IMG], nin=1, scalar=True))  # noise-level map
    ops.append(
        (
            ["aten::cat"],
            _shape_args([[img, [1, 1, H, W_IMG]], []], ["TensorList", "Int"], [[], []], ["", "1"]),
            [(K_CAT, 3.0, [512, 1, 1], [128, 1, 1], 32, 0)],
        )
    )
    ops.append(
        (
            ["aten::replication_pad2d"],
            _shape_args(
                [[1, C + 1, H, W_IMG], []],
                ["float", "ScalarList"],
                [_contig([1, C + 1, H, W_IMG]), []],
                ["", "[0, 0, 0, 0]"],
            ),
            [(K_PAD, 3.0, [512, 1, 1], [256, 1, 1], 32, 0)],
        )
    )

    def resblock(c, h):
        r = [
            conv_op(c, c, h),
            ew_op("aten::relu", K_RELU, [1, c, h, h], nin=1),
            conv_op(c, c, h),
            ew_op("aten::add", K_ADD, [1, c, h, h], scalar=True),
        ]
        return r

    h = H
    ops.append(conv_op(C + 1, ch[0], h))  # head
    for lvl in range(3):
        for _ in range(4):
            ops += resblock(ch[lvl], h)
        ops.append(conv_op(ch[lvl], ch[lvl + 1], h, stride=2))
        h //= 2
    for _ in range(4):
        ops += resblock(ch[3], h)
    for lvl in (2, 1, 0):
        ops.append(ew_op("aten::add", K_ADD, [1, ch[lvl + 1], h, h], scalar=True))  # skip
        ops.append(conv_op(ch[lvl + 1], ch[lvl], h, stride=2, transpose=True))
        h *= 2
        for _ in range(4):
            ops += resblock(ch[lvl], h)
    ops.append(ew_op("aten::add", K_ADD, [1, ch[0], h, h], scalar=True))
    ops.append(conv_op(ch[0], C, h))  # tail
    return ops


GRAD_OPS = build_gradient_ops()
DEN_OPS = build_denoiser_ops()

DEVICE_PROPS = (
    '{\n      "id": %d, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 84929216512,\n'
    '      "computeMajor": 9, "computeMinor": 0,\n'
    '      "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,\n'
    '      "regsPerBlock": 65536, "warpSize": 32,\n'
    '      "sharedMemPerBlock": 49152, "numSms": 132\n'
    '    , "regsPerMultiprocessor": 65536, "sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472\n'
    "    }"
)


def fts(ns):
    """Kineto prints microseconds with 3 decimals (ns precision)."""
    return "%d.%03d" % (ns // 1000, ns % 1000)


class RankWriter:
    def __init__(self, rank, world, n_iters, iters_per_step, seed, fh, corr_base=1):
        self.rank, self.world = rank, world
        self.rng = random.Random(seed * 1000003 + rank)
        self.fh = fh
        self.n_iters = n_iters
        self.ips = iters_per_step
        self.dev = rank % 8
        self.pid = 2301 + 97 * rank
        self.tid = self.pid
        self.s_comp, self.s_nccl = 7, 23
        self.ext = 1  # External id / Record function id counter
        self.corr = corr_base  # CUPTI correlation id counter
        self.evidx = 0
        self.n_events = 0
        self.buf = []
        self.bytes = 0
        self.t0 = 6_427_343_405_215_108 + rank * 2_113  # ns, steady clock; ranks start close together
        self.first = True

    # ---- low level output -------------------------------------------------
    def emit(self, s):
        if self.first:
            self.first = False
            s = "\n  " + s
        else:
            s = ",\n  " + s
        self.buf.append(s)
        self.n_events += 1
        if len(self.buf) >= 4096:
            self.flush()

    def flush(self):
        if self.buf:
            data = "".join(self.buf).encode()
            self.bytes += len(data)
            self.fh.write(data)
            self.buf = []

    def write_raw(self, s):
        data = s.encode()
        self.bytes += len(data)
        self.fh.write(data)

    def x_cpu(self, cat, name, ts, dur, args_body):
        self.emit(
            '{\n    "ph": "X", "cat": "%s", "name": "%s", "pid": %d, "tid": %d,\n    "ts": %s, "dur": %s,\n'
            '    "args": {\n      %s\n    }\n  }' % (cat, name, self.pid, self.tid, fts(ts), fts(dur), args_body)
        )

    def cpu_op(self, name, ts, dur, shape_args=None, ext=None):
        ext = self.ext if ext is None else ext
        body = '"External id": %d,"Record function id": 0, ' % ext
        if shape_args:
            body += shape_args + ", "
        body += '"Ev Idx": %d' % self.evidx
        self.evidx += 1
        self.x_cpu("cpu_op", name, ts, dur, body)

    def user_anno(self, name, ts, dur, ext):
        self.x_cpu(
            "user_annotation",
            name,
            ts,
            dur,
            '"External id": %d,"Record function id": 0, "Ev Idx": %d' % (ext, self.evidx),
        )
        self.evidx += 1

    def runtime(self, cat, name, ts, dur, ext, corr, cbid):
        self.x_cpu(cat, name, ts, dur, '"External id": %d,  "cbid": %d, "correlation": %d' % (ext, cbid, corr))

    def kernel(self, name, ts, dur, stream, ext, corr, grid, block, regs, smem, extra=""):
        blocks = grid[0] * grid[1] * grid[2]
        bps = blocks / 132.0
        wps = bps * (block[0] * block[1] * block[2]) / 32.0
        occ = min(100, int(wps / 64 * 100))
        self.emit(
            '{\n    "ph": "X", "cat": "kernel", "name": "%s", "pid": %d, "tid": %d,\n    "ts": %s, "dur": %s,\n'
            '    "args": {\n      "External id": %d,\n      "queued": 0, "device": %d, "context": 1,\n'
            '      "stream": %d, "correlation": %d,\n      "registers per thread": %d,\n'
            '      "shared memory": %d,\n      "blocks per SM": %.6f,\n      "warps per SM": %.6f,\n'
            '      "grid": [%d, %d, %d],\n      "block": [%d, %d, %d],\n      "est. achieved occupancy %%": %d%s\n'
            "    }\n  }"
            % (
                name,
                self.dev,
                stream,
                fts(ts),
                fts(dur),
                ext,
                self.dev,
                stream,
                corr,
                regs,
                smem,
                bps,
                wps,
                grid[0],
                grid[1],
                grid[2],
                block[0],
                block[1],
                block[2],
                occ,
                extra,
            )
        )

    def flow(self, corr, cpu_ts, gpu_ts, stream):
        self.emit(
            '{\n    "ph": "s", "id": %d, "pid": %d, "tid": %d, "ts": %s,\n    "cat": "ac2g", "name": "ac2g"\n  }'
            % (corr, self.pid, self.tid, fts(cpu_ts))
        )
        self.emit(
            '{\n    "ph": "f", "id": %d, "pid": %d, "tid": %d, "ts": %s,\n    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }'
            % (corr, self.dev, stream, fts(gpu_ts))
        )

    def gpu_anno(self, name, ts, dur, stream, ext):
        self.emit(
            '{\n    "ph": "X", "cat": "gpu_user_annotation", "name": "%s", "pid": %d, "tid": %d,\n'
            '    "ts": %s, "dur": %s,\n    "args": {\n      "External id": %d\n    }\n  }'
            % (name, self.dev, stream, fts(ts), fts(dur), ext)
        )

    # ---- model ---------------------------------------------------------------
    def j(self, lo, hi):
        return int(self.rng.uniform(lo, hi) * 1000)  # us -> ns

    def run_op(self, op, cpu_t, gpu_t):
        """One aten op: nested cpu_op chain, one launch per kernel. Returns (cpu_end, gpu_end)."""
        chain, shape_args, kernels = op
        depth = len(chain)
        starts = []
        t = cpu_t
        exts = []
        for lvl in range(depth):
            starts.append(t)
            exts.append(self.ext)
            self.ext += 1
            t += self.j(1.0, 3.5) if lvl == 0 else self.j(0.6, 2.0)
        launch_ext = exts[-1]
        for kname, kdur_us, grid, block, regs, smem in kernels:
            l_ts = t + self.j(0.3, 1.2)
            l_dur = self.j(3.0, 7.5)
            corr = self.corr
            self.corr += 1
            k_ts = max(gpu_t, l_ts + self.j(4.0, 9.0))
            k_dur = max(1000, int(kdur_us * 1000 * self.rng.uniform(0.92, 1.10)))
            self.runtime("cuda_runtime", "cudaLaunchKernel", l_ts, l_dur, launch_ext, corr, 211)
            self.kernel(kname, k_ts, k_dur, self.s_comp, launch_ext, corr, grid, block, regs, smem)
            self.flow(corr, l_ts, k_ts, self.s_comp)
            gpu_t = k_ts + k_dur + self.j(0.8, 2.5)
            t = l_ts + l_dur
        # close the chain inner-most first, each parent ends a bit later
        end = t + self.j(0.4, 1.5)
        for lvl in range(depth - 1, -1, -1):
            self.cpu_op(chain[lvl], starts[lvl], end - starts[lvl], shape_args if lvl == 0 else None, exts[lvl])
            end += self.j(0.3, 1.2)
        return end, gpu_t

    def allreduce(self, cpu_t, gpu_comp_t, gpu_nccl_t, nelems, step_skew):
        """c10d::allreduce_ > record_param_comms > nccl:all_reduce > cuLaunchKernelEx; returns cpu_end, nccl_end."""
        e_c10d, e_rpc, e_nccl = self.ext, self.ext + 1, self.ext + 2
        self.ext += 3
        t = cpu_t
        c10d_ts = t
        t += self.j(2, 5)
        rpc_ts = t
        t += self.j(3, 8)
        # event record on compute stream + wait on NCCL stream
        c1 = self.corr
        self.corr += 1
        self.runtime("cuda_runtime", "cudaEventRecord", t, self.j(1.5, 3), e_rpc, c1, 133)
        t += self.j(2, 4)
        c2 = self.corr
        self.corr += 1
        self.runtime("cuda_runtime", "cudaStreamWaitEvent", t, self.j(1.5, 3), e_rpc, c2, 132)
        t += self.j(2, 4)
        nccl_ts = t
        t += self.j(4, 9)
        corr = self.corr
        self.corr += 1
        l_ts, l_dur = t, self.j(6, 14)
        self.runtime("cuda_driver", "cuLaunchKernelEx", l_ts, l_dur, e_nccl, corr, 307)
        t = l_ts + l_dur
        nbytes = nelems * 4
        # ring allreduce: intra-node NVLink for W<=8, IB across nodes beyond
        bw = 180e3 if self.world <= 8 else 40e3  # bytes/us
        k_dur = int((15 + 2 * (self.world - 1) / self.world * nbytes / bw) * 1000 * self.rng.uniform(0.95, 1.08))
        k_ts = max(gpu_comp_t, gpu_nccl_t, l_ts + self.j(6, 12))
        k_dur += step_skew  # waiting for the slowest rank shows up inside the NCCL kernel
        ranks = json.dumps(list(range(self.world)))
        extra = (
            ',\n      "Collective name": "allreduce", "In msg nelems": %d, "Out msg nelems": %d, "Group size": %d,'
            '\n      "dtype": "Float", "In split size": "[]", "Out split size": "[]", "Process Group Name": "0",'
            ' "Process Group Description": "default_pg", "Process Group Ranks": "%s"'
            % (nelems, nelems, self.world, ranks)
        )
        self.kernel(K_NCCL, k_ts, k_dur, self.s_nccl, e_rpc, corr, [2, 1, 1], [512, 1, 1], 96, 0, extra)
        self.flow(corr, l_ts, k_ts, self.s_nccl)
        self.gpu_anno("nccl:all_reduce", k_ts, k_dur, self.s_nccl, e_nccl)
        c3 = self.corr
        self.corr += 1
        t += self.j(1, 3)
        self.runtime("cuda_runtime", "cudaEventRecord", t, self.j(1.5, 3), e_rpc, c3, 133)
        t += self.j(2, 4)
        nccl_end = t
        t += self.j(1, 2)
        rpc_end = t
        t += self.j(2, 6)
        self.x_cpu(
            "user_annotation",
            "nccl:all_reduce",
            nccl_ts,
            nccl_end - nccl_ts,
            '"External id": %d,"Record function id": 0, "Ev Idx": %d' % (e_nccl, self.evidx),
        )
        self.evidx += 1
        rpc_args = (
            '"External id": %d,"Record function id": 0, "Concrete Inputs": ["", "", "", "", "", "", "", "", "", ""], '
            '"Input type": ["Int", "Int", "Int", "Int", "Int", "Int", "Int", "Int", "Int", "Int"], '
            '"Input Strides": [[], [], [], [], [], [], [], [], [], []], '
            '"Input Dims": [[], [], [], [], [], [], [], [], [], []], '
            '"Ev Idx": %d, "Collective name": "allreduce", "dtype": "Float", "In msg nelems": %d, '
            '"Out msg nelems": %d, "Group size": %d, "In split size": "[]", "Out split size": "[]", '
            '"Global rank start": 0, "Global rank stride": 1, "Process Group Name": "0", '
            '"Process Group Description": "default_pg", "Process Group Ranks": "%s", "Rank": %d'
            % (e_rpc, self.evidx, nelems, nelems, self.world, ranks, self.rank)
        )
        self.evidx += 1
        self.x_cpu("cpu_op", "record_param_comms", rpc_ts, rpc_end - rpc_ts, rpc_args)
        self.cpu_op(
            "c10d::allreduce_",
            c10d_ts,
            t - c10d_ts,
            _shape_args(
                [[[1, C, H, W_IMG]], [], [], [], []],
                ["TensorList", "Object", "Object", "Int", "Int"],
                [[], [], [], [], []],
                ["", "", "", "", "-1"],
            ),
            e_c10d,
        )
        t += self.j(1, 3)
        return t, k_ts + k_dur

    def section(self, name, ops, cpu_t, gpu_t, gpu_nccl_t, nelems, skew):
        ext = self.ext
        self.ext += 1
        sec_ts = cpu_t
        cpu_t += self.j(1, 3)
        first_k = None
        for op in ops:
            cpu_t, g_end = self.run_op(op, cpu_t, gpu_t)
            if first_k is None:
                first_k = gpu_t
            gpu_t = g_end
            cpu_t += self.j(1.5, 6)  # python overhead between ops
        self.gpu_anno(name, first_k, gpu_t - first_k, self.s_comp, ext)
        cpu_t, nccl_end = self.allreduce(cpu_t, gpu_t, gpu_nccl_t, nelems, skew)
        cpu_t += self.j(1, 3)
        self.user_anno(name, sec_ts, cpu_t - sec_ts, ext)
        cpu_t += self.j(1, 3)
        return cpu_t, gpu_t, nccl_end

    def item_sync(self, cpu_t, gpu_t):
        """aten::item > aten::_local_scalar_dense > cudaMemcpyAsync (+DtoH memcpy) > cudaStreamSynchronize."""
        e1, e2 = self.ext, self.ext + 1
        self.ext += 2
        t0 = cpu_t
        t = t0 + self.j(1, 2.5)
        t1 = t
        t += self.j(1, 2.5)
        corr = self.corr
        self.corr += 1
        l_ts, l_dur = t, self.j(5, 10)
        self.runtime("cuda_runtime", "cudaMemcpyAsync", l_ts, l_dur, e2, corr, 41)
        m_ts = max(gpu_t, l_ts + self.j(4, 8))
        m_dur = self.j(1.2, 2.0)
        self.emit(
            '{\n    "ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "pid": %d, "tid": %d,\n'
            '    "ts": %s, "dur": %s,\n    "args": {\n      "External id": %d,\n      "device": %d, "context": 1,\n'
            '      "stream": %d, "correlation": %d,\n      "bytes": 4, "memory bandwidth (GB/s)": %.6f\n    }\n  }'
            % (self.dev, self.s_comp, fts(m_ts), fts(m_dur), e2, self.dev, self.s_comp, corr, 4 / m_dur)
        )
        self.flow(corr, l_ts, m_ts, self.s_comp)
        t = l_ts + l_dur
        c2 = self.corr
        self.corr += 1
        s_ts = t + self.j(0.5, 1)
        s_end = max(s_ts + self.j(2, 4), m_ts + m_dur + self.j(3, 8))
        self.runtime("cuda_runtime", "cudaStreamSynchronize", s_ts, s_end - s_ts, e2, c2, 131)
        t = s_end + self.j(1, 2)
        self.cpu_op("aten::_local_scalar_dense", t1, t - t1, _shape_args([[]], ["float"], [[]], [""]), e2)
        t += self.j(0.5, 1.5)
        self.cpu_op("aten::item", t0, t - t0, _shape_args([[]], ["float"], [[]], [""]), e1)
        return t + self.j(2, 6), m_ts + m_dur

    def header(self):
        w = self.world
        nnodes = (w + 7) // 8
        hdr = (
            '{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    %s\n  ],\n'
            '  "cupti_version": 24,\n  "cuda_runtime_version": 12080,\n  "with_flops": 0,\n  "record_shapes": 1,\n'
            '  "cuda_driver_version": 12080,\n  "profile_memory": 0,\n  "with_stack": 0,\n  "with_modules": 0,\n'
            '  "trace_id": "%032X",\n  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1740000000000000000,\n'
            '  "distributedInfo": {"backend": "nccl", "rank": %d, "world_size": %d, "pg_count": 1, "pg_config": '
            '[{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": %d, "ranks": %s}], '
            '"nccl_version": "2.27.5"},\n  "traceEvents": ['
            % (
                ",\n    ".join(DEVICE_PROPS % d for d in range(min(8, w))),
                self.rng.getrandbits(128),
                self.rank,
                w,
                w,
                json.dumps(list(range(w))),
            )
        )
        del nnodes
        self.write_raw(hdr)

    def metadata(self, t_first, t_last):
        ts = fts(t_first)
        ev = []
        ev.append(
            '{\n    "name": "process_name", "ph": "M", "ts": %s, "pid": %d, "tid": 0,\n    "args": {\n      "name": "python"\n    }\n  }'
            % (ts, self.pid)
        )
        ev.append(
            '{\n    "name": "process_labels", "ph": "M", "ts": %s, "pid": %d, "tid": 0,\n    "args": {\n      "labels": "CPU"\n    }\n  }'
            % (ts, self.pid)
        )
        ev.append(
            '{\n    "name": "process_sort_index", "ph": "M", "ts": %s, "pid": %d, "tid": 0,\n    "args": {\n      "sort_index": %d\n    }\n  }'
            % (ts, self.pid, self.pid)
        )
        ev.append(
            '{\n    "name": "process_name", "ph": "M", "ts": %s, "pid": %d, "tid": 0,\n    "args": {\n      "name": "python"\n    }\n  }'
            % (ts, self.dev)
        )
        ev.append(
            '{\n    "name": "process_labels", "ph": "M", "ts": %s, "pid": %d, "tid": 0,\n    "args": {\n      "labels": "GPU %d"\n    }\n  }'
            % (ts, self.dev, self.dev)
        )
        ev.append(
            '{\n    "name": "process_sort_index", "ph": "M", "ts": %s, "pid": %d, "tid": 0,\n    "args": {\n      "sort_index": %d\n    }\n  }'
            % (ts, self.dev, 16777216 + self.dev)
        )
        for s in (self.s_comp, self.s_nccl):
            ev.append(
                '{\n    "name": "thread_name", "ph": "M", "ts": %s, "pid": %d, "tid": %d,\n    "args": {\n      "name": "stream %d %s"\n    }\n  }'
                % (ts, self.dev, s, s, "" if s == self.s_comp else "NCCL")
            )
            ev.append(
                '{\n    "name": "thread_sort_index", "ph": "M", "ts": %s, "pid": %d, "tid": %d,\n    "args": {\n      "sort_index": %d\n    }\n  }'
                % (ts, self.dev, s, s)
            )
        ev.append(
            '{\n    "name": "thread_name", "ph": "M", "ts": %s, "pid": %d, "tid": %d,\n    "args": {\n      "name": "thread %d (python)"\n    }\n  }'
            % (ts, self.pid, self.tid, self.tid)
        )
        ev.append(
            '{\n    "name": "thread_sort_index", "ph": "M", "ts": %s, "pid": %d, "tid": %d,\n    "args": {\n      "sort_index": %d\n    }\n  }'
            % (ts, self.pid, self.tid, self.tid)
        )
        ev.append(
            '{\n    "ph": "X", "cat": "Trace", "ts": %s, "dur": %s,\n    "pid": "Spans", "tid": "PyTorch Profiler",\n'
            '    "name": "PyTorch Profiler (0)",\n    "args": {\n      "Op count": 0\n    }\n  }'
            % (ts, fts(t_last - t_first))
        )
        ev.append(
            '{\n    "name": "process_sort_index", "ph": "M", "ts": %s, "pid": "Spans", "tid": 0,\n    "args": {\n      "sort_index": 536870912\n    }\n  }'
            % ts
        )
        ev.append(
            '{\n    "name": "Iteration Start: PyTorch Profiler", "ph": "i", "s": "g",\n    "pid": "Traces", "tid": "Trace PyTorch Profiler", "ts": %s\n  }'
            % ts
        )
        ev.append(
            '{\n    "name": "Record Window End", "ph": "i", "s": "g",\n    "pid": "", "tid": "", "ts": %s\n  }'
            % fts(t_last + 1000)
        )
        for e in ev:
            self.emit(e)

    def run(self):
        self.header()
        cpu_t = self.t0
        gpu_t = cpu_t + 20_000
        gpu_nccl = gpu_t
        nelems = C * H * W_IMG
        n_steps = (self.n_iters + self.ips - 1) // self.ips
        it = 0
        # a slightly different per-rank speed makes the NCCL wait (skew) realistic
        speed = self.rng.uniform(0.97, 1.03)
        for step in range(n_steps):
            step_ext = self.ext
            self.ext += 1
            step_ts = cpu_t
            cpu_t += self.j(3, 8)
            for _ in range(self.ips):
                if it >= self.n_iters:
                    break
                it += 1
                skew = int(self.rng.expovariate(1 / 20.0) * 1000)  # us -> ns wait inside NCCL kernel
                cpu_t, gpu_t, gpu_nccl = self.section("gradient", GRAD_OPS, cpu_t, gpu_t, gpu_nccl, nelems, skew)
                gpu_t = max(gpu_t, gpu_nccl - int(30_000 * speed))  # next compute partially overlaps the allreduce
                cpu_t, gpu_t, gpu_nccl = self.section("denoiser", DEN_OPS, cpu_t, gpu_t, gpu_nccl, nelems, skew)
                gpu_t = max(gpu_t, gpu_nccl)  # x_{k+1} needs the reduced result
                cpu_t, gpu_t = self.item_sync(cpu_t, gpu_t)
            cpu_t += self.j(3, 8)
            self.user_anno("ProfilerStep#%d" % (step + 2), step_ts, cpu_t - step_ts, step_ext)
            cpu_t += self.j(5, 15)
        self.metadata(self.t0 - 50_000, max(cpu_t, gpu_t))
        self.flush()
        self.write_raw('\n  ],\n  "traceName": "rank%d.pt.trace.json"\n}' % self.rank)
        return self.n_events


def _write_rank(args):
    out, rank, world, n_iters, ips, seed, gz, level, corr_base = args
    fn = os.path.join(
        out, "rank%d.node%d_%d.1740000000000.pt.trace.json%s" % (rank, rank // 8, 2301 + 97 * rank, ".gz" if gz else "")
    )
    if gz:
        fh = gzip.open(fn, "wb", compresslevel=level)
    else:
        fh = open(fn, "wb", buffering=1 << 20)
    w = RankWriter(rank, world, n_iters, ips, seed, fh, corr_base)
    n = w.run()
    fh.close()
    return {"rank": rank, "file": fn, "events": n, "raw_bytes": w.bytes, "disk_bytes": os.path.getsize(fn)}


def bytes_per_iter(world):
    class Null:
        def write(self, b):
            pass

    a = RankWriter(0, world, 2, 1, 0, Null())
    a.run()
    b = RankWriter(0, world, 4, 1, 0, Null())
    b.run()
    return (b.bytes - a.bytes) / 2.0, a.bytes - (b.bytes - a.bytes)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", type=int, required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--target-mb", type=float, help="target uncompressed MB (1e6 B) per rank")
    g.add_argument("--iters", type=int, help="number of PnP iterations")
    ap.add_argument("--iters-per-step", type=int, default=1, help="PnP iterations per ProfilerStep")
    ap.add_argument("--gz", action="store_true")
    ap.add_argument("--level", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument(
        "--corr-base",
        type=int,
        default=100001,
        help="first CUPTI correlation id (default 100001, i.e. a window after warm-up). With 1, traces "
        "with >32767 events but max correlation <32768 crash HTA 0.5.0 under pandas 3.x "
        "(int16 index_correlation, hta/common/trace.py transform_correlation_to_index)",
    )
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.target_mb is not None:
        per_it, fixed = bytes_per_iter(a.ranks)
        n_iters = max(3, int(round((a.target_mb * 1e6 - fixed) / per_it)))
    else:
        n_iters = a.iters
    t0 = time.time()
    jobs = [(a.out, r, a.ranks, n_iters, a.iters_per_step, a.seed, a.gz, a.level, a.corr_base) for r in range(a.ranks)]
    if a.jobs > 1:
        with mp.Pool(min(a.jobs, a.ranks)) as p:
            res = p.map(_write_rank, jobs, chunksize=1)
    else:
        res = [_write_rank(j) for j in jobs]
    meta = {
        "ranks": a.ranks,
        "pnp_iters": n_iters,
        "iters_per_step": a.iters_per_step,
        "profiler_steps": (n_iters + a.iters_per_step - 1) // a.iters_per_step,
        "gz": a.gz,
        "gzip_level": a.level if a.gz else None,
        "seed": a.seed,
        "corr_base": a.corr_base,
        "kernels_per_pnp_iter": sum(len(o[2]) for o in GRAD_OPS + DEN_OPS) + 2 + 1,
        "files": res,
        "total_raw_bytes": sum(r["raw_bytes"] for r in res),
        "total_disk_bytes": sum(r["disk_bytes"] for r in res),
        "events_per_rank_mean": sum(r["events"] for r in res) / len(res),
        "raw_bytes_per_rank_mean": sum(r["raw_bytes"] for r in res) / len(res),
        "gen_seconds": round(time.time() - t0, 1),
    }
    # kept outside the trace dir: HTA treats every *.json / *.gz file in trace_dir as a trace
    with open(a.out.rstrip("/") + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
    summary = {k: v for k, v in meta.items() if k != "files"}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
