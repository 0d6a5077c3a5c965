"""fuse_mel: the STFT power -> mel chain of ingot.models.audio (with its chunks' concat and its dB scale)
becomes one FUSED "stft_mel" op that computes what the chain computed."""
import numpy as np
import pytest

import ingot
from ingot.ir import Op
from ingot.models import audio
from ingot.passes.fuse_mel import cosine_window, fuse_mel
from fusion_helpers import assert_same_on_cpu, kinds


def compiled(build, n=2345):
    g = ingot.Graph()
    s = g.placeholder((n,), ingot.float32, name="signal")
    outs = build(g, s)
    return g.compile(targets=list(outs) if isinstance(outs, tuple) else [outs])


def feeds(n=2345, seed=0):
    return {"signal": np.random.default_rng(seed).standard_normal(n).astype(np.float32)}


def fused_ops(program):
    return [n for n in program.nodes() if n.op == Op.FUSED]


@pytest.mark.parametrize("window,in_body", [("hann", True), ("hamming", True), (("gaussian", 7.0), False)])
def test_chain_becomes_one_op(window, in_body):
    exe = compiled(lambda g, s: audio.mel_spectrogram(g, s, sample_rate=16000, n_fft=256, hop_length=97,
                                                      n_mels=24, window=window))
    chunks = sum(n.op == Op.RFFT for n in exe.program.nodes())
    after, changed = fuse_mel(exe.program)
    assert changed and kinds(after) == {"stft_mel": 1}
    (op,) = fused_ops(after)
    body_ops = [n.op for n in op.attrs["body"].nodes if n.op != Op.PLACEHOLDER]
    assert body_ops.count(Op.RFFT) == chunks and Op.MATMUL in body_ops and Op.ABS in body_ops
    # a cosine window goes in (the kernel applies it in frequency); another is multiplied in before
    assert (Op.MUL in body_ops[:body_ops.index(Op.RFFT)]) == in_body
    assert not any(n.op in (Op.RFFT, Op.ABS) for n in after.nodes())
    assert_same_on_cpu(exe, after, feeds())


def test_chunks_and_db_scale_become_one_op():
    exe = compiled(lambda g, s: audio.log_mel_spectrogram(g, s, sample_rate=16000, n_fft=400, hop_length=160,
                                                          n_mels=40, pad_mode="reflect", frames_per_chunk=5), n=4001)
    chunks = sum(n.op == Op.RFFT for n in exe.program.nodes())
    assert chunks > 2
    after, _ = fuse_mel(exe.program)
    (op,) = fused_ops(after)
    body = op.attrs["body"]
    assert len(body.find(Op.RFFT)) == chunks and len(body.find(Op.CONCAT)) == 1
    assert body.find(Op.LOG), "the dB scale's log is in the op"
    assert_same_on_cpu(exe, after, feeds(4001, seed=1))
    plain, _ = fuse_mel(exe.program, epilogue=False)
    (op,) = fused_ops(plain)
    assert not op.attrs["body"].find(Op.LOG)
    assert_same_on_cpu(exe, plain, feeds(4001, seed=1))


def test_mel_read_elsewhere_keeps_the_scale_outside():
    def build(g, s):
        mel = audio.mel_spectrogram(g, s, sample_rate=16000, n_fft=256, hop_length=64, n_mels=24)
        return mel, audio.power_to_db(g, mel)
    exe = compiled(build)
    after, _ = fuse_mel(exe.program)
    (op,) = fused_ops(after)
    assert op.attrs["body"].outputs[0].op in (Op.MATMUL, Op.CONCAT) and not op.attrs["body"].find(Op.LOG)
    assert_same_on_cpu(exe, after, feeds())


def test_left_alone_when_the_spectrum_is_read_elsewhere():
    def build(g, s):
        spec = audio.stft(g, s, n_fft=256, hop_length=64)
        return audio.power_spectrum(g, spec), g.abs(spec)
    exe = compiled(build)
    after, changed = fuse_mel(exe.program)
    assert not changed and not kinds(after)


def test_cosine_window_recognition():
    assert cosine_window(audio.get_window("hann", 400)) == pytest.approx((0.5, 0.5))
    assert cosine_window(audio.get_window("hamming", 401)) == pytest.approx((0.54, 0.46))
    assert cosine_window(np.ones(7)) == pytest.approx((1.0, 0.0))
    assert cosine_window(audio.get_window(("gaussian", 9.5), 64)) is None
    assert cosine_window(audio._padded_window("hann", 200, 256)) is None
    assert cosine_window(np.ones(2)) is None
