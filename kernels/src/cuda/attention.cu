// Causal self-attention on tensor cores, flash style (FlashAttention-2's
// loop order), for bf16 `q | k | v` rows and head dims 64 and 128.
// Compiled at run time by NVRTC to a cubin (see nvrtc.rs and
// attention.rs); no toolkit header: bf16 travels as raw 16-bit words, and
// the tensor-core work is inline PTX (`ldmatrix`, `mma.sync.m16n8k16` with
// bf16 operands and fp32 accumulators, `cp.async`), all sm_80 and later.
//
// Layout, as ops.cu's CUDA-core attention: row `b * seq + t` of `qkv`
// holds q (`heads x head_dim`), then k and v (`kv_heads x head_dim` each);
// `out` and `dout` rows hold `heads x head_dim`; `lse` and `dsum` are
// `batch x heads x seq` fp32.
//
// - Grouped-query heads: query head h reads key/value head h / (heads /
//   kv_heads) in place, K and V never copied per query head.
// - Packed sequences: with position ids (`ids`, one u32 per row; null
//   without) row t sees the keys from its document's start, t - ids[row],
//   to itself: causal within each document, nothing across them. A block
//   skips the key tiles before its rows' earliest start.
//
// - The forward keeps each row's log-sum-exp (natural log), nothing s x s.
// - The backward is deterministic (no atomics): one kernel owns a block of
//   query rows and writes their dq, another owns a block of keys and
//   writes their dk and dv; both recompute the probabilities from `lse`.
//   `dsum` (D = rowsum(dout * out)) comes first, from its own kernel.
// - Scores, softmax and accumulators are fp32; the probabilities and
//   dscores enter the second product of each pass as bf16 (rounded to
//   nearest even), as in FlashAttention.
// - Sizes and offsets are 64-bit.
// - The CPU reference is kernels/src/cpu/backend.rs's attention (fp32,
//   whole s x s matrices); kernels/tests/cuda_ops.rs compares them.

typedef unsigned short bf16_t;
typedef unsigned long long u64;
typedef unsigned u32;

struct AttnShape {
    u64 batch, seq, heads, kv_heads, head_dim;
};

// Query rows per block (16 per warp), keys per tile, warps per block.
#define FLASH_ROWS 64
#define FLASH_KEYS 64
#define FLASH_THREADS 128
// bf16 elements of padding after each shared-memory row: rows then start
// 4 banks apart, so `ldmatrix`'s eight row reads hit 32 distinct banks.
#define FLASH_PAD 8

#define LOG2E 1.4426950408889634f
#define NEG_INF (-__int_as_float(0x7f800000))
#define LN2 0.6931471805599453f

__device__ __forceinline__ u32 shared_address(const void *p) {
    u32 address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
        : "=r"(address)
        : "l"(p));
    return address;
}

// 16 bytes global -> shared, asynchronously; zeros where `valid` is false
// (source size 0: nothing is read).
__device__ __forceinline__ void copy_async(u32 dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N> __device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8x8 bf16 matrices from shared memory; lane i gives the address of
// row i % 8 of matrix i / 8, register j receives matrix j.
__device__ __forceinline__ void load_matrices(u32 address, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
}

// As load_matrices, each matrix transposed.
__device__ __forceinline__ void load_matrices_transposed(u32 address, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address)
                 : "memory");
}

// c += a b for one 16x8 tile: a 16x16 (row), b 16x8 (col), fp32 c.
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats to bf16 (nearest even), `low` in the low half.
__device__ __forceinline__ u32 pack(float low, float high) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
}

__device__ __forceinline__ float bf16_low(u32 pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_high(u32 pair) { return __uint_as_float(pair & 0xffff0000u); }

// Rows `first ..` (those below `limit`; zeros past it) of one head's part
// into a shared tile of `ROWS x (D + FLASH_PAD)`, 16 bytes per copy.
template <int D, int ROWS>
__device__ __forceinline__ void load_tile(bf16_t *tile, const bf16_t *base, u64 row_stride,
                                          u64 first, u64 limit) {
    constexpr int CHUNKS = D / 8;
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += FLASH_THREADS) {
        const int r = e / CHUNKS, c = (e % CHUNKS) * 8;
        const u64 row = first + r;
        const bool valid = row < limit;
        const bf16_t *src = base + (valid ? row : 0) * row_stride + c;
        copy_async(shared_address(tile + r * (D + FLASH_PAD) + c), src, valid);
    }
}

// The A fragments (16 rows x 16 columns, `chunk` of them along the row)
// of the 16 rows at `row0` of a shared tile.
template <int D>
__device__ __forceinline__ void load_a(const bf16_t *tile, int row0, int chunk, u32 (&a)[4]) {
    const int lane = threadIdx.x % 32;
    const int row = row0 + ((lane >> 3) & 1) * 8 + (lane & 7);
    const int col = chunk * 16 + (lane >> 4) * 8;
    load_matrices(shared_address(tile + row * (D + FLASH_PAD) + col), a);
}

// B fragments of two 8-wide n tiles for a product against a tile's rows:
// rows `n0 .. n0 + 16` of the tile are n, columns `chunk * 16 ..` are k.
// b[0], b[1] are the first n tile's, b[2], b[3] the second's.
template <int D>
__device__ __forceinline__ void load_b_rows(const bf16_t *tile, int n0, int chunk, u32 (&b)[4]) {
    const int lane = threadIdx.x % 32;
    const int row = n0 + (lane >> 4) * 8 + (lane & 7);
    const int col = chunk * 16 + ((lane >> 3) & 1) * 8;
    load_matrices(shared_address(tile + row * (D + FLASH_PAD) + col), b);
}

// B fragments of two 8-wide n tiles where the tile's rows are k: rows
// `k0 .. k0 + 16` are k, columns `n0 .. n0 + 16` are n (transposed loads).
template <int D>
__device__ __forceinline__ void load_b_columns(const bf16_t *tile, int k0, int n0, u32 (&b)[4]) {
    const int lane = threadIdx.x % 32;
    const int row = k0 + ((lane >> 3) & 1) * 8 + (lane & 7);
    const int col = n0 + (lane >> 4) * 8;
    load_matrices_transposed(shared_address(tile + row * (D + FLASH_PAD) + col), b);
}

// The A fragment of 16 x 16 from two 16x8 fp32 accumulator tiles (the
// probabilities or dscores of 16 consecutive columns), rounded to bf16.
__device__ __forceinline__ void accumulators_to_a(const float (&left)[4], const float (&right)[4],
                                                  u32 (&a)[4]) {
    a[0] = pack(left[0], left[1]);
    a[1] = pack(left[2], left[3]);
    a[2] = pack(right[0], right[1]);
    a[3] = pack(right[2], right[3]);
}

// s = A1 B1^T and dp = A2 B2^T for the warp's 16 rows `row0 ..` of the
// shared tiles `a1`, `a2` against the K rows of `b1`, `b2` (D columns each):
// the backward's scores and dP, from the same loop over D.
template <int D, int K>
__device__ __forceinline__ void two_products(float (&s)[K / 8][4], float (&dp)[K / 8][4],
                                             const bf16_t *a1, const bf16_t *a2, int row0,
                                             const bf16_t *b1, const bf16_t *b2) {
#pragma unroll
    for (int n = 0; n < K / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            s[n][i] = 0.0f;
            dp[n][i] = 0.0f;
        }
    }
#pragma unroll
    for (int c = 0; c < D / 16; ++c) {
        u32 f1[4], f2[4];
        load_a<D>(a1, row0, c, f1);
        load_a<D>(a2, row0, c, f2);
#pragma unroll
        for (int n = 0; n < K / 16; ++n) {
            u32 b[4];
            load_b_rows<D>(b1, n * 16, c, b);
            mma(s[2 * n], f1, b[0], b[1]);
            mma(s[2 * n + 1], f1, b[2], b[3]);
            load_b_rows<D>(b2, n * 16, c, b);
            mma(dp[2 * n], f2, b[0], b[1]);
            mma(dp[2 * n + 1], f2, b[2], b[3]);
        }
    }
}

// out += bf16(a) tile for the warp's 16 rows: `a` their K columns of fp32
// accumulators (K / 8 tiles of 16x8), `tile` K rows x D columns of shared
// memory whose rows are the product's k.
template <int D, int K>
__device__ __forceinline__ void accumulate_times_tile(float (&out)[D / 8][4],
                                                      const float (&a)[K / 8][4],
                                                      const bf16_t *tile) {
#pragma unroll
    for (int c = 0; c < K / 16; ++c) {
        u32 fragment[4];
        accumulators_to_a(a[2 * c], a[2 * c + 1], fragment);
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
            u32 b[4];
            load_b_columns<D>(tile, c * 16, n * 16, b);
            mma(out[2 * n], fragment, b[0], b[1]);
            mma(out[2 * n + 1], fragment, b[2], b[3]);
        }
    }
}

// The first key row t of sequence b sees: its document's start (0 without
// position ids).
__device__ __forceinline__ u64 first_key(AttnShape a, const u32 *ids, u64 b, u64 t) {
    return ids ? t - min((u64)ids[b * a.seq + t], t) : 0;
}

// The smallest `value` over the block's FLASH_THREADS threads; every
// thread gets it.
__device__ u64 block_min(u64 value) {
    __shared__ u64 warps[FLASH_THREADS / 32];
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        value = min(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    if (threadIdx.x % 32 == 0) {
        warps[threadIdx.x / 32] = value;
    }
    __syncthreads();
    u64 total = warps[0];
    #pragma unroll
    for (int w = 1; w < FLASH_THREADS / 32; ++w) {
        total = min(total, warps[w]);
    }
    __syncthreads();
    return total;
}

// What a thread of a block of FLASH_ROWS query rows of one (sequence,
// head) works from: the sizes, its rows (the longest, the last blocks
// under the causal mask, start first), where its query head's q and its
// key/value head's k and v start, its warp and place in the warp, the key
// tiles its rows see (`first` to `tiles - 1`), and the score scale in log2
// units. `start` holds the first key of its two rows (`group` and `group +
// 8` of the warp's 16). Every thread of the block calls it (a barrier).
struct QueryBlock {
    u64 seq, hidden, stride, head, b, q0;
    const bf16_t *base, *keys, *values;
    int warp, group, quad, first, tiles;
    float scale;
    u64 start[2];
};

template <int D>
__device__ __forceinline__ QueryBlock query_block(AttnShape a, const u32 *ids, const bf16_t *qkv) {
    QueryBlock q;
    q.seq = a.seq;
    q.hidden = a.heads * D;
    const u64 kv_hidden = a.kv_heads * D;
    q.stride = q.hidden + 2 * kv_hidden;
    q.head = blockIdx.y;
    q.b = blockIdx.z;
    q.q0 = (u64)(gridDim.x - 1 - blockIdx.x) * FLASH_ROWS;
    const bf16_t *row0 = qkv + q.b * q.seq * q.stride;
    const u64 kv_head = q.head / (a.heads / a.kv_heads);
    q.base = row0 + q.head * D;
    q.keys = row0 + q.hidden + kv_head * D;
    q.values = q.keys + kv_hidden;
    const int lane = threadIdx.x % 32;
    q.warp = threadIdx.x / 32;
    q.group = lane / 4;
    q.quad = lane % 4;
    const u64 keys = min(q.q0 + FLASH_ROWS, q.seq);
    q.tiles = (int)((keys + FLASH_KEYS - 1) / FLASH_KEYS);
    q.scale = LOG2E / sqrtf((float)D);
    u64 earliest = ~0ull;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u64 row = q.q0 + q.warp * 16 + q.group + 8 * h;
        q.start[h] = row < q.seq ? first_key(a, ids, q.b, row) : 0;
        earliest = row < q.seq ? min(earliest, q.start[h]) : earliest;
    }
    q.first = ids ? (int)(block_min(earliest) / FLASH_KEYS) : 0;
    return q;
}

// grid (ceil(seq / FLASH_ROWS), heads, batch), FLASH_THREADS threads,
// (FLASH_ROWS + 4 FLASH_KEYS) x (D + FLASH_PAD) bf16 of dynamic shared
// memory: the query tile and two stages of key and value tiles.
template <int D>
__device__ void flash_forward(AttnShape a, const u32 *ids, const bf16_t *qkv, bf16_t *out,
                              float *lse) {
    extern __shared__ __align__(16) bf16_t shared[];
    constexpr int LD = D + FLASH_PAD;
    bf16_t *tile_q = shared;
    bf16_t *tile_k = tile_q + FLASH_ROWS * LD;
    bf16_t *tile_v = tile_k + 2 * FLASH_KEYS * LD;
    const auto [seq, hidden, stride, head, b, q0, base, keys, values, warp, group, quad, first,
                tiles, scale, start] = query_block<D>(a, ids, qkv);

    load_tile<D, FLASH_ROWS>(tile_q, base, stride, q0, seq);
    load_tile<D, FLASH_KEYS>(tile_k, keys, stride, (u64)first * FLASH_KEYS, seq);
    load_tile<D, FLASH_KEYS>(tile_v, values, stride, (u64)first * FLASH_KEYS, seq);
    copy_commit();

    float o[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    }
    // Running max (log2 units, scaled) and this thread's part of the sum,
    // for rows `group` and `group + 8` of the warp's 16.
    float row_max[2] = {NEG_INF, NEG_INF};
    float row_sum[2] = {0.0f, 0.0f};
    u32 q[D / 16][4];
    for (int j = first; j < tiles; ++j) {
        // Stages alternate from the first tile's (stage 0).
        const int stage = (j - first) % 2;
        if (j + 1 < tiles) {
            const u64 k0 = (u64)(j + 1) * FLASH_KEYS;
            load_tile<D, FLASH_KEYS>(tile_k + (1 - stage) * FLASH_KEYS * LD, keys, stride, k0,
                                     seq);
            load_tile<D, FLASH_KEYS>(tile_v + (1 - stage) * FLASH_KEYS * LD, values, stride, k0,
                                     seq);
            copy_commit();
            copy_wait<1>();
        } else {
            copy_wait<0>();
        }
        __syncthreads();
        if (j == first) {
            #pragma unroll
            for (int c = 0; c < D / 16; ++c) {
                load_a<D>(tile_q, warp * 16, c, q[c]);
            }
        }
        const bf16_t *k = tile_k + stage * FLASH_KEYS * LD;
        const bf16_t *v = tile_v + stage * FLASH_KEYS * LD;
        float s[FLASH_KEYS / 8][4];
        #pragma unroll
        for (int n = 0; n < FLASH_KEYS / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
        }
        #pragma unroll
        for (int c = 0; c < D / 16; ++c) {
            #pragma unroll
            for (int n = 0; n < FLASH_KEYS / 16; ++n) {
                u32 bk[4];
                load_b_rows<D>(k, n * 16, c, bk);
                mma(s[2 * n], q[c], bk[0], bk[1]);
                mma(s[2 * n + 1], q[c], bk[2], bk[3]);
            }
        }
        // The diagonal tile (the last: FLASH_KEYS = FLASH_ROWS) masks the
        // keys after each row, and with position ids every tile masks the
        // keys before each row's document; keys past the end come after
        // every row before it. Rows past the end are computed but not
        // stored.
        const bool masked = ids != nullptr || j == tiles - 1;
        const u64 k0 = (u64)j * FLASH_KEYS;
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const u64 row = q0 + warp * 16 + group + 8 * h;
            float top = row_max[h];
            #pragma unroll
            for (int n = 0; n < FLASH_KEYS / 8; ++n) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = s[n][2 * h + e] * scale;
                    const u64 key = k0 + n * 8 + 2 * quad + e;
                    if (masked && (key > row || key < start[h])) {
                        x = NEG_INF;
                    }
                    s[n][2 * h + e] = x;
                    top = fmaxf(top, x);
                }
            }
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
            // A row whose document starts after this tile has seen no key
            // yet: `top` is -inf, and it keeps nothing and adds nothing
            // (exp2 of -inf is 0) rather than a NaN. Its own key, in the
            // diagonal tile, makes it finite by the end.
            const float shift = top == NEG_INF ? 0.0f : top;
            const float keep = exp2f(row_max[h] - shift);
            row_max[h] = top;
            row_sum[h] *= keep;
            #pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][2 * h] *= keep;
                o[n][2 * h + 1] *= keep;
            }
            #pragma unroll
            for (int n = 0; n < FLASH_KEYS / 8; ++n) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float p = exp2f(s[n][2 * h + e] - shift);
                    s[n][2 * h + e] = p;
                    row_sum[h] += p;
                }
            }
        }
        accumulate_times_tile<D, FLASH_KEYS>(o, s, v);
        // The stage just read is the next iteration's copy target.
        __syncthreads();
    }
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        float total = row_sum[h];
        total += __shfl_xor_sync(0xffffffffu, total, 1);
        total += __shfl_xor_sync(0xffffffffu, total, 2);
        const u64 row = q0 + warp * 16 + group + 8 * h;
        if (row >= seq) {
            continue;
        }
        const float inverse = 1.0f / total;
        u32 *dst = (u32 *)(out + (b * seq + row) * hidden + head * D);
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            dst[n * 4 + quad] = pack(o[n][2 * h] * inverse, o[n][2 * h + 1] * inverse);
        }
        if (quad == 0) {
            lse[(b * a.heads + head) * seq + row] = (row_max[h] + log2f(total)) * LN2;
        }
    }
}

// D = rowsum(dout * out) of every (row, head), one warp each; grid-stride
// over batch x seq x heads warps. `dsum` as `lse`.
__device__ void dsum_rows(AttnShape a, const bf16_t *out, const bf16_t *dout, float *dsum) {
    const u64 d = a.head_dim, rows = a.batch * a.seq * a.heads;
    const u64 warps = (u64)gridDim.x * (blockDim.x / 32);
    const int lane = threadIdx.x % 32;
    for (u64 w = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; w < rows; w += warps) {
        // w = (b * seq + t) * heads + head: out's own order.
        const u64 head = w % a.heads, bt = w / a.heads;
        const u64 b = bt / a.seq, t = bt % a.seq;
        const u32 *o = (const u32 *)(out + w * d), *g = (const u32 *)(dout + w * d);
        float sum = 0.0f;
        for (u64 c = lane; c < d / 2; c += 32) {
            const u32 x = o[c], y = g[c];
            sum += bf16_low(x) * bf16_low(y) + bf16_high(x) * bf16_high(y);
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
            sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        }
        if (lane == 0) {
            dsum[(b * a.heads + head) * a.seq + t] = sum;
        }
    }
}

// The backward's query side: dq for FLASH_ROWS query rows. Grid and block
// as the forward; 4 tiles of FLASH_ROWS (= FLASH_KEYS) x (D + FLASH_PAD)
// bf16 of dynamic shared memory: q, dout, k, v.
template <int D>
__device__ void flash_backward_dq(AttnShape a, const u32 *ids, const bf16_t *qkv,
                                  const bf16_t *dout, const float *lse, const float *dsum,
                                  bf16_t *dqkv) {
    extern __shared__ __align__(16) bf16_t shared[];
    constexpr int LD = D + FLASH_PAD;
    bf16_t *tile_q = shared;
    bf16_t *tile_do = tile_q + FLASH_ROWS * LD;
    bf16_t *tile_k = tile_do + FLASH_ROWS * LD;
    bf16_t *tile_v = tile_k + FLASH_KEYS * LD;
    const auto [seq, hidden, stride, head, b, q0, base, keys, values, warp, group, quad, first,
                tiles, scale, start] = query_block<D>(a, ids, qkv);

    load_tile<D, FLASH_ROWS>(tile_q, base, stride, q0, seq);
    load_tile<D, FLASH_ROWS>(tile_do, dout + b * seq * hidden + head * D, hidden, q0, seq);
    // Each row's log-sum-exp (log2 units) and D; rows past the end get a
    // probability of zero.
    float row_lse[2], row_dsum[2];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u64 row = q0 + warp * 16 + group + 8 * h;
        const u64 at = (b * a.heads + head) * seq + row;
        row_lse[h] = row < seq ? lse[at] * LOG2E : __int_as_float(0x7f800000);
        row_dsum[h] = row < seq ? dsum[at] : 0.0f;
    }
    float dq[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
    }
    for (int j = first; j < tiles; ++j) {
        const u64 k0 = (u64)j * FLASH_KEYS;
        load_tile<D, FLASH_KEYS>(tile_k, keys, stride, k0, seq);
        load_tile<D, FLASH_KEYS>(tile_v, values, stride, k0, seq);
        copy_commit();
        copy_wait<0>();
        __syncthreads();
        float s[FLASH_KEYS / 8][4], dp[FLASH_KEYS / 8][4];
        two_products<D, FLASH_KEYS>(s, dp, tile_q, tile_do, warp * 16, tile_k, tile_v);
        // P and then dS = P (dP - D), in place of dp. Rows past the end
        // have an lse of infinity (p = 0); keys past it come after every
        // row before it, so the causal mask (only in the diagonal tile:
        // FLASH_KEYS = FLASH_ROWS) covers them. With position ids every
        // tile masks the keys before each row's document.
        const bool masked = ids != nullptr || k0 == q0;
        #pragma unroll
        for (int n = 0; n < FLASH_KEYS / 8; ++n) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int h = i / 2;
                float p = exp2f(s[n][i] * scale - row_lse[h]);
                const u64 key = k0 + n * 8 + 2 * quad + (i % 2);
                const u64 row = q0 + warp * 16 + group + 8 * h;
                if (masked && (key > row || key < start[h])) {
                    p = 0.0f;
                }
                dp[n][i] = p * (dp[n][i] - row_dsum[h]);
            }
        }
        accumulate_times_tile<D, FLASH_KEYS>(dq, dp, tile_k);
        __syncthreads();
    }
    const float softmax_scale = 1.0f / sqrtf((float)D);
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u64 row = q0 + warp * 16 + group + 8 * h;
        if (row >= seq) {
            continue;
        }
        u32 *dst = (u32 *)(dqkv + (b * seq + row) * stride + head * D);
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            dst[n * 4 + quad] =
                pack(dq[n][2 * h] * softmax_scale, dq[n][2 * h + 1] * softmax_scale);
        }
    }
}

// Query rows per tile of the key side: 64, or 32 at head dim 128, where
// the dk and dv accumulators (128 registers a thread) leave no room for a
// 64-wide tile's scores and dP.
#define FLASH_KV_ROWS(D) ((D) == 128 ? 32 : 64)

// The backward's key side: dk and dv for FLASH_KEYS keys of one key/value
// head, from every query that sees them, of each query head it serves in
// turn (heads, then query tiles, in order: no atomics). grid
// (ceil(seq / FLASH_KEYS), kv_heads, batch), FLASH_THREADS threads; k, v
// (FLASH_KEYS rows) and q, dout (FLASH_KV_ROWS(D) rows) tiles of D +
// FLASH_PAD bf16, then FLASH_KV_ROWS(D) of those rows' lse and D (floats)
// and first keys (u64) of dynamic shared memory.
template <int D>
__device__ void flash_backward_dkv(AttnShape a, const u32 *ids, const bf16_t *qkv,
                                   const bf16_t *dout, const float *lse, const float *dsum,
                                   bf16_t *dqkv) {
    extern __shared__ __align__(16) bf16_t shared[];
    constexpr int LD = D + FLASH_PAD, KV = FLASH_KV_ROWS(D);
    bf16_t *tile_k = shared;
    bf16_t *tile_v = tile_k + FLASH_KEYS * LD;
    bf16_t *tile_q = tile_v + FLASH_KEYS * LD;
    bf16_t *tile_do = tile_q + KV * LD;
    u64 *tile_start = (u64 *)(tile_do + KV * LD);
    float *tile_lse = (float *)(tile_start + KV);
    float *tile_dsum = tile_lse + KV;
    const u64 seq = a.seq, hidden = a.heads * D, kv_hidden = a.kv_heads * D;
    const u64 stride = hidden + 2 * kv_hidden;
    const u64 kv_head = blockIdx.y, b = blockIdx.z, group_size = a.heads / a.kv_heads;
    // The keys with the most queries after them (the first) start first.
    const u64 k0 = (u64)blockIdx.x * FLASH_KEYS;
    const bf16_t *row0 = qkv + b * seq * stride;
    const bf16_t *keys = row0 + hidden + kv_head * D, *values = keys + kv_hidden;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = lane / 4, quad = lane % 4;
    const float scale = LOG2E / sqrtf((float)D);
    // The block's last key: a query tile none of whose rows' documents
    // start at or before it has nothing for these keys.
    const u64 last_key = k0 + FLASH_KEYS - 1;

    load_tile<D, FLASH_KEYS>(tile_k, keys, stride, k0, seq);
    load_tile<D, FLASH_KEYS>(tile_v, values, stride, k0, seq);
    // Their own group: the first query tile waited for (wait_group 0)
    // waits for them too, whichever tile that is.
    copy_commit();
    float dk[D / 8][4], dv[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            dk[n][i] = 0.0f;
            dv[n][i] = 0.0f;
        }
    }
    for (u64 head = kv_head * group_size; head < (kv_head + 1) * group_size; ++head) {
        const bf16_t *base = row0 + head * D;
        const bf16_t *dout_base = dout + b * seq * hidden + head * D;
        for (u64 i0 = k0 - k0 % KV; i0 < seq; i0 += KV) {
            bool needed = false;
            for (int r = threadIdx.x; r < KV; r += FLASH_THREADS) {
                const u64 row = i0 + r, at = (b * a.heads + head) * seq + row;
                const u64 first = row < seq ? first_key(a, ids, b, row) : 0;
                tile_start[r] = first;
                tile_lse[r] = row < seq ? lse[at] * LOG2E : __int_as_float(0x7f800000);
                tile_dsum[r] = row < seq ? dsum[at] : 0.0f;
                needed |= row < seq && first <= last_key;
            }
            // Without position ids every tile from the diagonal on is
            // needed; with them, skip the tiles of later documents (the
            // condition is the block's: every thread takes the barrier or
            // none does).
            if (ids != nullptr && !__syncthreads_or(needed)) {
                continue;
            }
            load_tile<D, KV>(tile_q, base, stride, i0, seq);
            load_tile<D, KV>(tile_do, dout_base, hidden, i0, seq);
            copy_commit();
            copy_wait<0>();
            __syncthreads();
            // Transposed scores and dP: rows are this warp's 16 keys,
            // columns the tile's queries.
            float s[KV / 8][4], dp[KV / 8][4];
            two_products<D, KV>(s, dp, tile_k, tile_v, warp * 16, tile_q, tile_do);
            // P^T into s, dS^T into dp. Rows past the end have an lse of
            // infinity (p = 0); only tiles that reach the diagonal mask the
            // queries before a key, and with position ids every tile masks
            // the queries whose document starts after it.
            const bool diagonal = i0 < k0 + FLASH_KEYS;
            const int lag = diagonal ? (int)(i0 - k0) : FLASH_KEYS;
            #pragma unroll
            for (int n = 0; n < KV / 8; ++n) {
                #pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = n * 8 + 2 * quad + (i % 2);
                    const int key = warp * 16 + group + 8 * (i / 2);
                    float p = exp2f(s[n][i] * scale - tile_lse[r]);
                    if (lag + r < key || (ids != nullptr && tile_start[r] > k0 + key)) {
                        p = 0.0f;
                    }
                    s[n][i] = p;
                    dp[n][i] = p * (dp[n][i] - tile_dsum[r]);
                }
            }
            accumulate_times_tile<D, KV>(dv, s, tile_do);
            accumulate_times_tile<D, KV>(dk, dp, tile_q);
            __syncthreads();
        }
    }
    const float softmax_scale = 1.0f / sqrtf((float)D);
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u64 key = k0 + warp * 16 + group + 8 * h;
        if (key >= seq) {
            continue;
        }
        u32 *dst_k = (u32 *)(dqkv + (b * seq + key) * stride + hidden + kv_head * D);
        u32 *dst_v = (u32 *)(dqkv + (b * seq + key) * stride + hidden + kv_hidden + kv_head * D);
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            dst_k[n * 4 + quad] =
                pack(dk[n][2 * h] * softmax_scale, dk[n][2 * h + 1] * softmax_scale);
            dst_v[n * 4 + quad] = pack(dv[n][2 * h], dv[n][2 * h + 1]);
        }
    }
}

#define FLASH_KERNELS(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 1) flash_forward_d##D(              \
        AttnShape a, const u32 *ids, const bf16_t *qkv, bf16_t *out, float *lse) {               \
        flash_forward<D>(a, ids, qkv, out, lse);                                                  \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 1) flash_backward_dq_d##D(           \
        AttnShape a, const u32 *ids, const bf16_t *qkv, const bf16_t *dout, const float *lse,    \
        const float *dsum, bf16_t *dqkv) {                                                        \
        flash_backward_dq<D>(a, ids, qkv, dout, lse, dsum, dqkv);                                 \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(FLASH_THREADS, 1) flash_backward_dkv_d##D(          \
        AttnShape a, const u32 *ids, const bf16_t *qkv, const bf16_t *dout, const float *lse,    \
        const float *dsum, bf16_t *dqkv) {                                                        \
        flash_backward_dkv<D>(a, ids, qkv, dout, lse, dsum, dqkv);                                \
    }

FLASH_KERNELS(64)
FLASH_KERNELS(128)

extern "C" __global__ void flash_dsum(AttnShape a, const bf16_t *out, const bf16_t *dout,
                                      float *dsum) {
    dsum_rows(a, out, dout, dsum);
}
