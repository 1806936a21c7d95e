"""Bit-level emulation of the two-path AWQ decode kernel of commit f85a825 (not on main; see
notes_awq.md, session 8): awq_repack_kernel's layout, Dq<T>::frags (fold path: raw nibbles as
fp16 subnormals, or 128 + q in bf16) and Dq<T>::frags_scaled (scaled path: (q - z) * s rounded
once), with the per-row constants of StripGroups::rows (each lane's own two rows, the others by
shuffle).  Checks every fragment value of a small weight, fp16 and bf16, at its (row, k).

    python benchmarks/probe/fold_layout_emulation.py     # prints "... match: True"
"""

import numpy as np

K, N, G = 64, 128, 32


def awq_order(i):
    return (i >> 1) + 4 * (i & 1)


def pack(v):
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.int64)
    for n in range(v.shape[1]):
        out[:, n // 8] |= v[:, n].astype(np.int64) << (4 * awq_order(n & 7))
    return out


def half(bits):
    return np.array([bits], dtype=np.uint16).view(np.float16)[0]


def halves(word):
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)


def bf16_value(bits):
    return np.array([bits << 16], dtype=np.uint32).view(np.float32)[0]


def bf16_round(f):
    """float32 -> bf16 bits, round to nearest even (as __hmul2 on bfloat162 rounds)."""
    b = int(np.array([f], dtype=np.float32).view(np.uint32)[0])
    return (b + 0x7FFF + ((b >> 16) & 1)) >> 16


class Weight:
    """A random AWQ weight, its packed and repacked forms, and the kernel's per-lane views."""

    def __init__(self, rng):
        self.q = rng.integers(0, 16, (K, N))
        self.z = rng.integers(0, 16, (K // G, N))
        self.qw, self.qz = pack(self.q), pack(self.z)

    def repacked(self, strip, kt, lane, j):  # awq_repack_kernel, word j of a lane
        word = 0
        for i in range(8):
            k = kt * 16 + 4 * (lane & 3) + (i >> 2) + 2 * (j & 1)
            n = strip * 64 + (2 * (j >> 1) + (i & 1)) * 16 + (lane >> 2) + 8 * ((i >> 1) & 1)
            word |= ((int(self.qw[k, n >> 3]) >> (4 * awq_order(n & 7))) & 0xF) << (4 * i)
        return word

    def own_z(self, strip, grp, lane, h):  # StripGroups: the zero of the lane's row 16t + g + 8h
        g, t = lane >> 2, lane & 3
        zword = int(self.qz[grp, (strip * 64 + 16 * t + 8 * h) // 8])
        return (zword >> (4 * awq_order(g))) & 0xF

    def sites(self):
        """Every fragment value: (strip, group, lane, tile, register r, half hh, k, n, the lane's
        four repacked words)."""
        for strip in range(N // 64):
            for kt in range(K // 16):
                grp = kt * 16 // G
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    w = [self.repacked(strip, kt, lane, j) for j in range(4)]
                    for tile in range(4):
                        for r in range(4):
                            for hh in range(2):
                                k = kt * 16 + 4 * t + hh + 2 * (r >> 1)
                                n = strip * 64 + 16 * tile + g + 8 * (r & 1)
                                yield strip, grp, lane, tile, r, hh, k, n, w


def sources(w, tile):
    """The words frags() masks for the tile's registers: (w0, w0 >> 8, w1, w1 >> 8) of the
    tile's word pair, the even tile's low nibbles and the odd tile's high ones."""
    u, v = w[tile & ~1], w[(tile & ~1) + 1]
    return [u, u >> 8, v, v >> 8]


def check_fp16(wt, s):
    """Dq<half>: fold fragments read q * 2^-24 (even tile) or q * 2^-20 (odd) as raw bits;
    scaled ones fp16((q - z) * s) from (1024 + q) - (1024 + z) or (1024 + 16q)/16 - (64 + z)."""
    ok = True
    for strip, grp, lane, tile, r, hh, k, n, w in wt.sites():
        src = sources(w, tile)[r]
        mask = 0x00F000F0 if tile & 1 else 0x000F000F
        raw = int(halves(src & mask).view(np.uint16)[hh])
        ok &= raw == wt.q[k, n] * (16 if tile & 1 else 1)
        # the row's constants, as the lane (g, tile) made them
        zz = wt.own_z(strip, grp, (lane & ~3) | tile, r & 1)
        t_val = halves((src & mask) | 0x64006400)[hh]
        if tile & 1:
            got = np.float16(np.float16(np.float32(t_val) / 16 + np.float32(half(0xD400 | (zz << 4)))) * s[grp, n])
        else:
            got = np.float16((t_val - half(0x6400 | zz)) * s[grp, n])
        ok &= got == np.float16(np.float16(wt.q[k, n] - wt.z[grp, n]) * s[grp, n])
    return bool(ok)


def check_bf16(wt, s_bits):
    """Dq<bf16>: fold fragments read 128 + q; scaled ones bf16(bf16(q - z) * s).  Each nibble is
    shifted to the bottom of its half: the odd tile's sources are 4 bits further down."""
    ok = True
    for strip, grp, lane, tile, r, hh, k, n, w in wt.sites():
        src = sources(w, tile)[r] >> (4 if tile & 1 else 0)
        val = bf16_value((((src & 0x000F000F) | 0x43004300) >> (16 * hh)) & 0xFFFF)
        ok &= val == 128 + wt.q[k, n]
        zz = wt.own_z(strip, grp, (lane & ~3) | tile, r & 1)
        diff = bf16_round(np.float32(val) - bf16_value(0x4300 | zz))
        got = bf16_round(np.float32(bf16_value(diff)) * bf16_value(s_bits[grp, n]))
        want = bf16_round(np.float32(wt.q[k, n] - wt.z[grp, n]) * bf16_value(s_bits[grp, n]))
        ok &= got == want
    return bool(ok)


def main():
    rng = np.random.default_rng(1)
    wt = Weight(rng)
    s = (rng.random((K // G, N)) * 2e-3 + 1e-4).astype(np.float16)
    s_bits = rng.integers(0x3A00, 0x3C00, (K // G, N))  # bf16 scales in [2^-11, 2^-7)
    print("fp16: fold and scaled fragments match:", check_fp16(wt, s))
    print("bf16: fold and scaled fragments match:", check_bf16(wt, s_bits))


if __name__ == "__main__":
    main()
