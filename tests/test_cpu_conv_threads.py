"""Convolutions on several threads (backends/cpu/conv.py `threaded_step`): a large conv of one image runs as
convs of consecutive output channels on the team, each part writing its channels of the output (too few
channels: bands of output rows); the direct kxk kernel, where its input is the larger, as bands of output
rows that it computes in place. Against the NumPy reference and the one-thread compile, on awkward channel counts, with the epilogue operands a fused conv reads
(a bias, a per-channel scale, a residual of the output's shape, scalar bounds), for each kernel family that
splits: the direct kxk kernel, the row kernel, the pointwise kernels (strided too), depthwise, 1-D."""
import numpy as np
import pytest

import ingot
from ingot.backends.cpu import team
from ingot.ops.conv import conv
from ingot.options import CompileOptions, CpuOptions

CASES = [  # C, M, spatial, window, strides, pads, groups, epilogue
    (24, 80, (33, 29), (3, 3), (1, 1), ((1, 1), (1, 1)), 1, "silu+residual"),
    (32, 96, (57, 45), (3, 3), (2, 2), ((1, 0), (1, 1)), 1, "relu"),
    (96, 160, (40, 38), (1, 1), (1, 1), ((0, 0), (0, 0)), 1, "scale+clip"),
    (64, 128, (66, 63), (1, 1), (2, 2), ((0, 0), (0, 0)), 1, "relu"),
    (3, 64, (160, 161), (3, 3), (2, 2), ((1, 1), (1, 1)), 1, "clip"),
    (72, 72, (60, 50), (3, 3), (1, 1), ((1, 1), (1, 1)), 72, "relu"),
    (88, 88, (41, 47), (5, 5), (2, 2), ((2, 2), (2, 2)), 88, "scale+clip"),
    (64, 96, (700,), (5,), (1,), ((2, 2),), 1, "relu"),
    # too few channels for two channel parts: bands of output rows, each over its input rows and padding
    (3, 24, (320, 241), (3, 3), (2, 2), ((1, 1), (1, 1)), 1, "clip"),
    (16, 16, (81, 79), (3, 3), (1, 1), ((1, 1), (1, 1)), 1, "silu+residual"),
    (48, 8, (97, 64), (3, 3), (2, 1), ((0, 2), (1, 1)), 1, "scale+clip"),
]


def _graph(c, m, spatial, window, strides, pads, groups, epilogue, images, rng):
    x = rng.standard_normal((images, c) + spatial).astype(np.float32)
    w = (rng.standard_normal((m, c // groups) + window) / np.sqrt(c // groups * np.prod(window))).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    want = conv(x, w, b, strides, (1,) * len(window), pads, groups)
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    y = g.conv(xi, w, b, strides=strides, pads=pads, groups=groups)
    feeds = {"x": x}
    if "silu" in epilogue:
        y = g.mul(y, g.sigmoid(y))
        want = want / (1 + np.exp(-want))
    if "residual" in epilogue:
        r = rng.standard_normal(want.shape).astype(np.float32)
        y = g.add(y, g.placeholder(r.shape, name="r"))
        feeds["r"] = r
        want = want + r
    if "scale" in epilogue:
        s = rng.uniform(0.5, 2.0, (m,) + (1,) * len(spatial)).astype(np.float32)
        y = g.mul(y, s)
        want = want * s
    if "relu" in epilogue:
        y = g.maximum(y, 0.0)
        want = np.maximum(want, 0)
    if "clip" in epilogue:
        y = g.minimum(g.maximum(y, 0.0), 6.0)
        want = np.clip(want, 0, 6)
    return g, y, feeds, want


@pytest.mark.parametrize("precision", ["float32", "bf16x3"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'x'.join(map(str, c[3]))}-g{c[6]}-{c[7]}")
def test_a_large_conv_splits_its_channels_over_threads(case, precision, monkeypatch):
    rng = np.random.default_rng(sum(case[2]) + case[1])
    g, y, feeds, want = _graph(*case, images=1, rng=rng)
    calls = []
    run_parts = team.run_parts
    monkeypatch.setattr(team, "run_parts", lambda fn, argsets, threads: calls.append(len(argsets)) or run_parts(fn, argsets, threads))
    outs = {}
    for threads in (1, 2, 3):
        exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(threads=threads, float32_precision=precision)))
        calls.clear()
        outs[threads] = exe.run(feeds)[0]
        parts = case[1] // 16 if case[1] // 16 >= 2 or len(case[2]) == 1 else want.shape[2] // 8   # channels, else rows
        assert calls == ([] if threads == 1 else [min(threads, parts)]), (threads, calls)
    tol = 1e-4 if precision == "float32" else 5e-3
    scale = float(np.abs(want).max())
    for threads, got in outs.items():
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=f"{threads} threads")
    np.testing.assert_allclose(outs[2], outs[1], rtol=tol, atol=tol * scale)


def test_small_convs_and_batches_stay_on_one_thread(monkeypatch):
    """Below PARALLEL_MIN_MACS, or more than one image (split only within an image), or too few channels and
    output rows for two parts (3 rows: no band of 2 a thread): no hand-off, and the same values."""
    calls = []
    monkeypatch.setattr(team, "run_parts", lambda fn, argsets, threads: calls.append(len(argsets)))
    options = CompileOptions(cpu=CpuOptions(threads=2))
    rng = np.random.default_rng(3)
    for case, images in (((8, 32, (9, 11), (3, 3), (1, 1), ((1, 1), (1, 1)), 1, "relu"), 1),
                         ((24, 80, (33, 29), (3, 3), (1, 1), ((1, 1), (1, 1)), 1, "relu"), 2),
                         ((64, 16, (3, 400), (3, 3), (1, 1), ((1, 1), (1, 1)), 1, "relu"), 1)):
        g, y, feeds, want = _graph(*case, images=images, rng=rng)
        got = g.compile(targets=[y], options=options).run(feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert calls == []


def test_a_channel_blocked_chain_splits_its_pointwise_and_depthwise_convs(monkeypatch):
    """Convs kept in 16-channel blocks between layers (passes/block_channels.py): a depthwise part reads
    and writes its blocks of a blocked input and output, a pointwise part reads the whole blocked input
    and adds its channels of an NCHW residual (72 and 80 channels: parts of 32 and 40 or 48, a last block of 8)."""
    rng = np.random.default_rng(7)

    def weights(m, c, k=1):
        return (rng.standard_normal((m, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)

    x = rng.standard_normal((1, 64, 40, 48)).astype(np.float32)
    w = [weights(96, 64), weights(96, 1, 3), weights(96, 1, 3), weights(64, 96), weights(72, 64), weights(80, 72)]
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    h = g.maximum(g.conv(xi, w[0]), 0.0)
    h = g.maximum(g.conv(h, w[1], None, pads=((1, 1), (1, 1)), groups=96), 0.0)
    h = g.maximum(g.conv(h, w[2], None, pads=((1, 1), (1, 1)), groups=96), 0.0)
    h = g.add(g.conv(h, w[3]), xi)
    y = g.conv(g.maximum(g.conv(h, w[4]), 0.0), w[5])
    one, none, same = (1, 1), ((0, 0), (0, 0)), ((1, 1), (1, 1))
    want = np.maximum(conv(x, w[0], None, one, one, none, 1), 0)
    want = np.maximum(conv(want, w[1], None, one, one, same, 96), 0)
    want = np.maximum(conv(want, w[2], None, one, one, same, 96), 0)
    want = conv(want, w[3], None, one, one, none, 1) + x
    want = conv(np.maximum(conv(want, w[4], None, one, one, none, 1), 0), w[5], None, one, one, none, 1)
    calls = []
    run_parts = team.run_parts
    monkeypatch.setattr(team, "run_parts", lambda fn, argsets, threads: calls.append(len(argsets)) or run_parts(fn, argsets, threads))
    exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(threads=2)))
    blocked = [n for n in exe.program.nodes() if n.op.name == "FUSED" and n.attrs["kind"] == "blocked"]
    assert [n.type.rank for n in blocked] == [5, 5, 4]   # expand+depthwise, depthwise, pointwise + residual
    got = exe.run({"x": x})[0]
    assert calls == [2, 2, 2, 2, 2]   # expand+depthwise: parts of the expanded channels
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("threads", [2, 3])
def test_an_expand_depthwise_op_splits_its_expanded_channels(threads, monkeypatch):
    """A 1x1 conv whose output only a depthwise conv reads (backends/cpu/expand_depthwise.py), stride 2, a
    per-channel scale between them: each part expands and filters its own channels (112: parts of 64 and
    48, or 32, 48 and 32)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, 40, 41, 48)).astype(np.float32)
    wa = (rng.standard_normal((112, 40, 1, 1)) / np.sqrt(40)).astype(np.float32)
    wb = (rng.standard_normal((112, 1, 3, 3)) / 3).astype(np.float32)
    ba, bb = rng.standard_normal(112).astype(np.float32), rng.standard_normal(112).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (112, 1, 1)).astype(np.float32)
    g = ingot.Graph()
    xi = g.placeholder(x.shape, name="x")
    h = g.mul(g.minimum(g.maximum(g.conv(xi, wa, ba), 0.0), 6.0), scale)
    y = g.maximum(g.conv(h, wb, bb, strides=(2, 2), pads=((1, 1), (1, 1)), groups=112), 0.0)
    want = np.clip(conv(x, wa, ba, (1, 1), (1, 1), ((0, 0), (0, 0)), 1), 0, 6) * scale
    want = np.maximum(conv(want, wb, bb, (2, 2), (1, 1), ((1, 1), (1, 1)), 112), 0)
    calls = []
    run_parts = team.run_parts
    monkeypatch.setattr(team, "run_parts", lambda fn, argsets, threads: calls.append(len(argsets)) or run_parts(fn, argsets, threads))
    exe = g.compile(targets=[y], options=CompileOptions(cpu=CpuOptions(threads=threads)))
    assert [n.attrs["kind"] for n in exe.program.nodes() if n.op.name == "FUSED"] == ["expand_depthwise"]
    got = exe.run({"x": x})[0]
    assert calls == [threads]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_two_python_threads_running_split_convs_at_once_get_their_own_values():
    """The pool serves one caller at a time; a second caller meanwhile runs its parts itself (before, their
    hand-offs shared the workers' queues and one could return before its parts were done)."""
    import threading

    rng = np.random.default_rng(13)
    case = (24, 80, (33, 29), (3, 3), (1, 1), ((1, 1), (1, 1)), 1, "silu+residual")
    options = CompileOptions(cpu=CpuOptions(threads=2))
    jobs = []
    for _ in range(2):
        g, y, feeds, want = _graph(*case, images=1, rng=rng)
        jobs.append((g.compile(targets=[y], options=options), feeds, want))
    errors = []

    def work(exe, feeds, want):
        try:
            for _ in range(20):
                got = exe.run(feeds)[0]
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.parametrize("runner", ["pool", "team"])
@pytest.mark.parametrize("raising", [0, 1])
def test_a_part_that_raises_leaves_the_threads_in_step(runner, raising):
    """A part raising (the caller's or a worker's) reaches the caller once every part is done, so the next
    run's completions are its own and no worker thread dies with its chunk uncounted."""
    calls = []

    def part(i):
        calls.append(i)
        if i == raising:
            raise ValueError(f"part {i}")

    run = team.run_parallel if runner == "pool" else lambda fn, argsets: team.run_parts(fn, argsets, 2)
    with pytest.raises(ValueError):
        run(part, [(0,), (1,)])
    run(part, [(2,), (3,)])
    assert sorted(calls) == [0, 1, 2, 3]


def test_parts_run_by_the_caller_alone_all_run_before_one_raises(monkeypatch):
    """When the team is busy (another thread's job, or its backoff) the caller runs every part itself: all of
    them, then the first error."""
    monkeypatch.setattr(team.Team, "run", lambda self, driver, args: False)
    calls = []

    def part(i):
        calls.append(i)
        if i == 0:
            raise ValueError("part 0")

    with pytest.raises(ValueError):
        team.run_parts(part, [(0,), (1,), (2,)], 2)
    assert calls == [0, 1, 2]


@pytest.mark.parametrize("case", [(24, 80, (33, 29), (3, 3), (1, 1), ((1, 1), (1, 1)), 1, "silu+residual"),
                                  (32, 40, (77, 61), (3, 3), (2, 2), ((1, 0), (1, 1)), 1, "relu"),
                                  (16, 32, (161, 160), (3, 3), (2, 2), ((1, 1), (1, 1)), 1, "scale+clip")],
                         ids=["residual", "stride2-uneven-pads", "ring"])
def test_the_direct_kernel_splits_its_output_rows_in_place(case, monkeypatch):
    """A direct conv whose input is larger than its weights (YOLO's 64 -> 64 at 40 x 40) splits into bands
    of output rows, the kernel writing each band's rows of the one output (no buffer, no copy), each band
    over its own padded rows: 1, 2 and 3 threads give the reference's values (rows not a multiple of the
    threads; a stride-2 ring of padded rows; a residual read row by row)."""
    from ingot.backends.cpu import conv as cpu_conv
    rng = np.random.default_rng(case[1])
    g, y, feeds, want = _graph(*case, images=1, rng=rng)
    bands = []
    run_band_part = cpu_conv._run_band_part
    monkeypatch.setattr(cpu_conv, "_run_band_part", lambda step, inputs, out, band: bands.append(band) or
                        run_band_part(step, inputs, out, band))
    scale = float(np.abs(want).max())
    for threads in (1, 2, 3):
        bands.clear()
        options = CompileOptions(cpu=CpuOptions(threads=threads, winograd_channels=0))   # (the direct kernel)
        got = g.compile(targets=[y], options=options).run(feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale, err_msg=f"{threads} threads")
        rows = want.shape[2]
        assert sorted(bands) == ([] if threads == 1 else
                                 [(rows * p // threads, rows * (p + 1) // threads, p) for p in range(threads)])
