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


def sites(repacked):
    """Every (strip, k-step, group, lane) with the lane's four repacked words."""
    for strip in range(N // 64):
        for kt in range(K // 16):
            for lane in range(32):
                yield strip, kt, kt * 16 // G, lane, [repacked(strip, kt, lane, j) for j in range(4)]


def check_bf16(q, z, s_bits, repacked, own_z):
    """Dq<bf16>: fold fragments read 128 + q; scaled ones bf16(bf16(q - z) * s)."""
    ok = True
    for strip, kt, grp, lane, w in sites(repacked):
        g, t = lane >> 2, lane & 3
        for p in range(2):
            u, v = w[2 * p], w[2 * p + 1]
            srcs = {2 * p: [u, u >> 8, v, v >> 8], 2 * p + 1: [u >> 4, u >> 12, v >> 4, v >> 12]}
            for tile, src in srcs.items():
                for r in range(4):
                    word = (src[r] & 0x000F000F) | 0x43004300
                    for hh in range(2):
                        row = 16 * tile + g + 8 * (r & 1)
                        k = kt * 16 + 4 * t + hh + 2 * (r >> 1)
                        n = strip * 64 + row
                        val = bf16_value((word >> (16 * hh)) & 0xFFFF)
                        ok &= val == 128 + q[k, n]
                        # the row's constants, as the lane (g, tile) made them: (128 + z), s
                        zz = own_z(strip, grp, (lane & ~3) | tile, r & 1)
                        diff = bf16_round(np.float32(val) - bf16_value(0x4300 | zz))
                        got = bf16_round(np.float32(bf16_value(diff)) * bf16_value(s_bits[grp, n]))
                        want = bf16_round(np.float32(q[k, n] - z[grp, n]) * bf16_value(s_bits[grp, n]))
                        ok &= got == want
    return bool(ok)


def main():
    rng = np.random.default_rng(1)
    q = rng.integers(0, 16, (K, N))
    z = rng.integers(0, 16, (K // G, N))
    s = (rng.random((K // G, N)) * 2e-3 + 1e-4).astype(np.float16)
    qw, qz = pack(q), pack(z)

    def repacked(strip, kt, lane, j):  # awq_repack_kernel, word j of a lane
        word = 0
        for i in range(8):
            k = kt * 16 + 4 * (lane & 3) + (i >> 2) + 2 * (j & 1)
            n = strip * 64 + (2 * (j >> 1) + (i & 1)) * 16 + (lane >> 2) + 8 * ((i >> 1) & 1)
            word |= ((int(qw[k, n >> 3]) >> (4 * awq_order(n & 7))) & 0xF) << (4 * i)
        return word

    def own_row(strip, grp, lane, h):  # Dq<half>::make for row 16t + g + 8h of the lane
        g, t = lane >> 2, lane & 3
        zword = int(qz[grp, (strip * 64 + 16 * t + 8 * h) // 8])
        zz = (zword >> (4 * awq_order(g))) & 0xF
        n = strip * 64 + 16 * t + g + 8 * h
        return {"zlo": half(0x6400 | zz), "zhi": half(0xD400 | (zz << 4)), "s": s[grp, n]}

    ok = True
    for strip, kt, grp, lane, w in sites(repacked):
        g, t = lane >> 2, lane & 3
        rows = [[own_row(strip, grp, (lane & ~3) | j, h) for h in range(2)] for j in range(4)]
        for p in range(2):
            src = [w[2 * p], w[2 * p] >> 8, w[2 * p + 1], w[2 * p + 1] >> 8]
            for r in range(4):
                lo, hi = rows[2 * p][r & 1], rows[2 * p + 1][r & 1]
                raw = {2 * p: halves(src[r] & 0x000F000F).view(np.uint16),
                       2 * p + 1: halves(src[r] & 0x00F000F0).view(np.uint16)}
                t_lo = halves((src[r] & 0x000F000F) | 0x64006400)
                t_hi = halves((src[r] & 0x00F000F0) | 0x64006400)
                scaled = {2 * p: ((t_lo - lo["zlo"]) * lo["s"]).astype(np.float16),
                          2 * p + 1: (np.float16(t_hi.astype(np.float32) / 16 + np.float32(hi["zhi"]))
                                      * hi["s"]).astype(np.float16)}
                for tile, unit in ((2 * p, 1), (2 * p + 1, 16)):
                    for hh in range(2):
                        row = 16 * tile + g + 8 * (r & 1)
                        k = kt * 16 + 4 * t + hh + 2 * (r >> 1)
                        n = strip * 64 + row
                        ok &= raw[tile][hh] == q[k, n] * unit
                        ok &= scaled[tile][hh] == np.float16(np.float16(q[k, n] - z[grp, n]) * s[grp, n])
    print("fp16: fold and scaled fragments match:", bool(ok))

    s_bits = rng.integers(0x3A00, 0x3C00, (K // G, N))  # bf16 scales in [2^-11, 2^-7)

    def own_z(strip, grp, lane, h):  # the zero of row 16t + g + 8h, from the packed word
        g, t = lane >> 2, lane & 3
        zword = int(qz[grp, (strip * 64 + 16 * t + 8 * h) // 8])
        return (zword >> (4 * awq_order(g))) & 0xF

    print("bf16: fold and scaled fragments match:", check_bf16(q, z, s_bits, repacked, own_z))


if __name__ == "__main__":
    main()
