// strata's element-wise and row kernels for CUDA, compiled at run time by
// NVRTC to a cubin for the device's architecture (see nvrtc.rs). No toolkit
// header is included: bf16 is carried as its 16 raw bits, and the only
// device functions used are NVRTC's built-ins.
//
// Conventions, the same in every kernel:
// - sizes and indices are 64-bit (`u64`): micro-batch x seq x vocab passes
//   2^31 at realistic sizes;
// - element-wise kernels are grid-stride loops, so any grid covers any n;
// - every reduction has a fixed order (a fixed block size, a fixed tree,
//   rows summed in order), so results are the same bits run to run: no
//   floating-point atomics anywhere;
// - arithmetic is in fp32 (sums of squares in fp64), rounded once on store;
//   fp32 -> bf16 rounds to nearest even and keeps NaN a (quiet) NaN, as
//   the CPU reference does;
// - each kernel's CPU reference is the function of the same name in
//   kernels/src/cpu/ops.rs (or strata_optim for adamw).

typedef unsigned short bf16_t;
typedef unsigned long long u64;

// The block size every row and reduction kernel is launched with.
#define BLOCK 256
// Blocks of the first pass of a sum of squares (its partials).
#define SUM_BLOCKS 256

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((unsigned)h) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    unsigned bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((bits >> 16) | 0x40u);
    }
    return (bf16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float load(const float *p, u64 i) { return p[i]; }
__device__ __forceinline__ float load(const bf16_t *p, u64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store(float *p, u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16_t *p, u64 i, float v) { p[i] = f32_to_bf16(v); }

__device__ __forceinline__ bool is_finite_f32(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

__device__ __forceinline__ u64 first_index() {
    return (u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ u64 grid_stride() {
    return (u64)gridDim.x * blockDim.x;
}

// The sum of `value` over the block, in a fixed order (a shared-memory
// tree); every thread gets it. `scratch` holds BLOCK elements.
template <typename A>
__device__ A block_sum(A value, A *scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (unsigned half = BLOCK / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            scratch[threadIdx.x] += scratch[threadIdx.x + half];
        }
        __syncthreads();
    }
    A total = scratch[0];
    __syncthreads();
    return total;
}

__device__ float block_max(float value, float *scratch) {
    scratch[threadIdx.x] = value;
    __syncthreads();
    for (unsigned half = BLOCK / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + half]);
        }
        __syncthreads();
    }
    float total = scratch[0];
    __syncthreads();
    return total;
}

#define GELU_C 0.7978846f

template <typename T>
__device__ void gelu(const T *x, T *out, u64 n) {
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        float v = load(x, i);
        float t = tanhf(GELU_C * (v + 0.044715f * v * v * v));
        store(out, i, 0.5f * v * (1.0f + t));
    }
}

template <typename T>
__device__ void gelu_backward(const T *dout, const T *x, T *dx, u64 n) {
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        float v = load(x, i);
        float u = GELU_C * (v + 0.044715f * v * v * v);
        float t = tanhf(u);
        float du = GELU_C * (1.0f + 3.0f * 0.044715f * v * v);
        float d = load(dout, i);
        store(dx, i, d * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du));
    }
}

template <typename T>
__device__ void add(T *y, const T *x, u64 n) {
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        store(y, i, load(y, i) + load(x, i));
    }
}

template <typename T>
__device__ void axpy(float alpha, const T *x, T *y, u64 n) {
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        store(y, i, load(y, i) + alpha * load(x, i));
    }
}

template <typename T>
__device__ void scale(float alpha, T *x, u64 n) {
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        store(x, i, alpha * load(x, i));
    }
}

template <typename T>
__device__ void add_bias(T *x, const float *bias, u64 rows, u64 cols) {
    u64 n = rows * cols;
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        store(x, i, load(x, i) + bias[i % cols]);
    }
}

// One thread per column, rows in order: the CPU's order, no atomics.
template <typename T>
__device__ void bias_grad(const T *dy, float *dbias, u64 rows, u64 cols) {
    for (u64 c = first_index(); c < cols; c += grid_stride()) {
        float sum = dbias[c];
        for (u64 r = 0; r < rows; ++r) {
            sum += load(dy, r * cols + c);
        }
        dbias[c] = sum;
    }
}

// One block per row (grid-stride over rows), BLOCK threads.
template <typename T>
__device__ void layer_norm(const T *x, const float *gamma, const float *beta, T *out,
                           float *mean, float *rstd, u64 rows, u64 cols, float eps) {
    __shared__ float scratch[BLOCK];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 base = r * cols;
        float sum = 0.0f;
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            sum += load(x, base + c);
        }
        const float m = block_sum(sum, scratch) / (float)cols;
        float squares = 0.0f;
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            float d = load(x, base + c) - m;
            squares += d * d;
        }
        const float var = block_sum(squares, scratch) / (float)cols;
        const float s = 1.0f / sqrtf(var + eps);
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            store(out, base + c, (load(x, base + c) - m) * s * gamma[c] + beta[c]);
        }
        if (threadIdx.x == 0) {
            mean[r] = m;
            rstd[r] = s;
        }
    }
}

// dx += ...: one block per row, as layer_norm.
template <typename T>
__device__ void layer_norm_backward_dx(const T *dout, const T *x, const float *gamma,
                                       const float *mean, const float *rstd, T *dx, u64 rows,
                                       u64 cols) {
    __shared__ float scratch[BLOCK];
    const float n = (float)cols;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 base = r * cols;
        const float m = mean[r], s = rstd[r];
        float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            float xhat = (load(x, base + c) - m) * s;
            float dxhat = load(dout, base + c) * gamma[c];
            sum_dxhat += dxhat;
            sum_dxhat_xhat += dxhat * xhat;
        }
        sum_dxhat = block_sum(sum_dxhat, scratch);
        sum_dxhat_xhat = block_sum(sum_dxhat_xhat, scratch);
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            float xhat = (load(x, base + c) - m) * s;
            float dxhat = load(dout, base + c) * gamma[c];
            float g = s * (dxhat - sum_dxhat / n - xhat * sum_dxhat_xhat / n);
            store(dx, base + c, load(dx, base + c) + g);
        }
    }
}

// dgamma += sum(dout * xhat), dbeta += sum(dout): one thread per column,
// rows in order.
template <typename T>
__device__ void layer_norm_backward_params(const T *dout, const T *x, const float *mean,
                                           const float *rstd, float *dgamma, float *dbeta,
                                           u64 rows, u64 cols) {
    for (u64 c = first_index(); c < cols; c += grid_stride()) {
        float dg = dgamma[c], db = dbeta[c];
        for (u64 r = 0; r < rows; ++r) {
            float d = load(dout, r * cols + c);
            dg += d * (load(x, r * cols + c) - mean[r]) * rstd[r];
            db += d;
        }
        dgamma[c] = dg;
        dbeta[c] = db;
    }
}

// A row that is not a loss target (strata_kernels::IGNORE_TARGET).
#define IGNORE_TARGET 0xffffffffu

// One block per row: the row's loss into row_loss, the gradient of the
// mean (times grad_scale) into dlogits. A target outside the vocabulary
// sets *bad to its row + 1 (the host checks it) and gives the row no loss;
// an IGNORE_TARGET row has no loss and a zero gradient, and still counts
// in the mean's divisor.
template <typename T>
__device__ void cross_entropy(const T *logits, const unsigned *targets, u64 rows, u64 vocab,
                              float grad_scale, T *dlogits, float *row_loss, u64 *bad) {
    __shared__ float scratch[BLOCK];
    const float per_row = grad_scale / (float)rows;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 base = r * vocab;
        const unsigned target = targets[r];
        if (target == IGNORE_TARGET) {
            // Not a loss target: no loss, a zero gradient (the whole block
            // takes the same branch: one row per block at a time).
            for (u64 c = threadIdx.x; c < vocab; c += BLOCK) {
                store(dlogits, base + c, 0.0f);
            }
            if (threadIdx.x == 0) {
                row_loss[r] = 0.0f;
            }
            continue;
        }
        float max = -__int_as_float(0x7f800000);
        for (u64 c = threadIdx.x; c < vocab; c += BLOCK) {
            max = fmaxf(max, load(logits, base + c));
        }
        max = block_max(max, scratch);
        float sum = 0.0f;
        for (u64 c = threadIdx.x; c < vocab; c += BLOCK) {
            sum += expf(load(logits, base + c) - max);
        }
        const float log_sum = logf(block_sum(sum, scratch)) + max;
        for (u64 c = threadIdx.x; c < vocab; c += BLOCK) {
            float d = expf(load(logits, base + c) - log_sum) * per_row;
            store(dlogits, base + c, c == target ? d - per_row : d);
        }
        if (threadIdx.x == 0) {
            if (target < vocab) {
                row_loss[r] = log_sum - load(logits, base + target);
            } else {
                row_loss[r] = 0.0f;
                *bad = r + 1;
            }
        }
    }
}

// A row's position: its position id, or its place in its sequence when
// there are none (`ids` null).
__device__ __forceinline__ u64 position_of(const unsigned *ids, u64 row, u64 seq) {
    return ids ? (u64)ids[row] : row % seq;
}

// out[i] = table[tokens[i]] + positions[position of i], rows of `hidden`;
// a null `positions` adds nothing (a model without a position table). A
// token outside the vocabulary, or a position id past the table, sets *bad
// to its row + 1 and gives the row zeros.
template <typename T>
__device__ void embedding(const float *table, const float *positions, const unsigned *tokens,
                          const unsigned *ids, u64 count, u64 seq, u64 hidden, u64 vocab, T *out,
                          u64 *bad) {
    u64 n = count * hidden;
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        u64 row = i / hidden, col = i % hidden;
        u64 token = tokens[row];
        u64 place = position_of(ids, row, seq);
        if (token >= vocab || (positions && place >= seq)) {
            *bad = row + 1;
            store(out, i, 0.0f);
            continue;
        }
        float value = table[token * hidden + col];
        if (positions) {
            value += positions[place * hidden + col];
        }
        store(out, i, value);
    }
}

// Adds each row of dout to the table row and position row it came from:
// one thread per column, tokens in order (the CPU's order, no atomics). A
// null `dpositions` takes nothing.
template <typename T>
__device__ void embedding_backward(const unsigned *tokens, const unsigned *ids, u64 count,
                                   u64 seq, u64 hidden, u64 vocab, const T *dout, float *dtable,
                                   float *dpositions) {
    for (u64 col = first_index(); col < hidden; col += grid_stride()) {
        for (u64 row = 0; row < count; ++row) {
            u64 token = tokens[row];
            u64 place = position_of(ids, row, seq);
            if (token >= vocab || (dpositions && place >= seq)) {
                continue;
            }
            float d = load(dout, row * hidden + col);
            dtable[token * hidden + col] += d;
            if (dpositions) {
                dpositions[place * hidden + col] += d;
            }
        }
    }
}

// RMSNorm, one block per row (grid-stride over rows), BLOCK threads:
// out = gamma * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps), kept per row.
template <typename T>
__device__ void rms_norm(const T *x, const float *gamma, T *out, float *rstd, u64 rows, u64 cols,
                         float eps) {
    __shared__ float scratch[BLOCK];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 base = r * cols;
        float squares = 0.0f;
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            const float v = load(x, base + c);
            squares += v * v;
        }
        const float s = 1.0f / sqrtf(block_sum(squares, scratch) / (float)cols + eps);
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            store(out, base + c, gamma[c] * (load(x, base + c) * s));
        }
        if (threadIdx.x == 0) {
            rstd[r] = s;
        }
    }
}

// dx += rstd (dout gamma - xhat mean(dout gamma xhat)): one block per row.
template <typename T>
__device__ void rms_norm_backward_dx(const T *dout, const T *x, const float *gamma,
                                     const float *rstd, T *dx, u64 rows, u64 cols) {
    __shared__ float scratch[BLOCK];
    const float n = (float)cols;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const u64 base = r * cols;
        const float s = rstd[r];
        float dot = 0.0f;
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            dot += load(dout, base + c) * gamma[c] * (load(x, base + c) * s);
        }
        dot = block_sum(dot, scratch);
        for (u64 c = threadIdx.x; c < cols; c += BLOCK) {
            const float xhat = load(x, base + c) * s;
            const float g = s * (load(dout, base + c) * gamma[c] - xhat * dot / n);
            store(dx, base + c, load(dx, base + c) + g);
        }
    }
}

// dgamma += sum over rows of dout * xhat: one thread per column, rows in
// order (deterministic, no atomics).
template <typename T>
__device__ void rms_norm_backward_gamma(const T *dout, const T *x, const float *rstd,
                                        float *dgamma, u64 rows, u64 cols) {
    for (u64 c = first_index(); c < cols; c += grid_stride()) {
        float dg = dgamma[c];
        for (u64 r = 0; r < rows; ++r) {
            dg += load(dout, r * cols + c) * (load(x, r * cols + c) * rstd[r]);
        }
        dgamma[c] = dg;
    }
}

// Rotary position embeddings in place on the first `turned` heads (the
// queries' and the keys') of each row of `qkv` (rows of `width`): in each
// head, elements k and k + half turn by position x inv_freq[k] (`sign`
// -1: back, the backward). Grid-stride over rows x turned x half pairs.
template <typename T>
__device__ void rotary(T *qkv, const unsigned *ids, const float *inv_freq, u64 rows, u64 seq,
                       u64 width, u64 turned, u64 half, float sign) {
    const u64 n = rows * turned * half;
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        const u64 k = i % half, head = (i / half) % turned, row = i / half / turned;
        // The angle in f32 (position x inv_freq), then its sine and cosine:
        // transformers' order, and the CPU reference's.
        const float angle = (float)position_of(ids, row, seq) * inv_freq[k];
        float sin, cos;
        sincosf(angle, &sin, &cos);
        sin *= sign;
        const u64 at = row * width + head * 2 * half + k;
        const float a = load(qkv, at), b = load(qkv, at + half);
        store(qkv, at, a * cos - b * sin);
        store(qkv, at + half, b * cos + a * sin);
    }
}

// SwiGLU: out = silu(gate) * up, each row of `gate_up` its gate (f
// columns) then its up projection (f columns).
template <typename T>
__device__ void swiglu(const T *gate_up, T *out, u64 rows, u64 f) {
    const u64 n = rows * f;
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        const u64 at = (i / f) * 2 * f + i % f;
        const float g = load(gate_up, at);
        store(out, i, g / (1.0f + expf(-g)) * load(gate_up, at + f));
    }
}

// SwiGLU's backward: dgate_up (as gate_up) from dout (as out).
template <typename T>
__device__ void swiglu_backward(const T *dout, const T *gate_up, T *dgate_up, u64 rows, u64 f) {
    const u64 n = rows * f;
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        const u64 at = (i / f) * 2 * f + i % f;
        const float g = load(gate_up, at), up = load(gate_up, at + f), d = load(dout, i);
        const float sig = 1.0f / (1.0f + expf(-g));
        store(dgate_up, at + f, d * (g * sig));
        store(dgate_up, at, d * up * sig * (1.0f + g * (1.0f - sig)));
    }
}

// First pass of a sum of squares: launched with SUM_BLOCKS blocks of
// BLOCK threads, one fp64 partial per block.
template <typename T>
__device__ void sum_squares_partials(const T *x, u64 n, double *partials) {
    __shared__ double scratch[BLOCK];
    double sum = 0.0;
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        double v = (double)load(x, i);
        sum += v * v;
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        partials[blockIdx.x] = sum;
    }
}

template <typename T>
__device__ void non_finite(const T *x, u64 n, unsigned *flag) {
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        if (!is_finite_f32(load(x, i))) {
            // Every writer stores the same value: no atomic needed.
            *flag = 1u;
        }
    }
}

template <typename S, typename T>
__device__ void cast(const S *x, T *y, u64 n) {
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        store(y, i, load(x, i));
    }
}

// Causal self-attention over packed rows `q | k | v` (q `heads x
// head_dim` wide, k and v `kv_heads x head_dim` each; row `b * seq + t`),
// flash-style: key and value tiles through shared memory, an online
// softmax, no seq x seq matrix in memory. One thread per query row. Query
// head h reads key/value head h / (heads / kv_heads) (grouped-query
// attention). Row t sees the keys from its document's start to itself:
// `t - ids[b * seq + t]` with position ids (documents packed into a
// sequence), 0 without (`ids` null). What the backward needs is each row's
// log-sum-exp (`lse`, batch x heads x seq). Scores, sums and outputs are
// fp32 whatever T is.
#define HEAD_DIM_MAX 128
#define ATTN_ROWS 64
#define ATTN_TILE 32

struct AttnShape {
    u64 batch, seq, heads, kv_heads, head_dim;
};

// Where part `part` (0 q, 1 k, 2 v) of head `head` (a query head for q, a
// key/value head for k and v) of row t of sequence b starts.
__device__ __forceinline__ u64 qkv_at(AttnShape a, u64 b, u64 t, u64 part, u64 head) {
    const u64 hidden = a.heads * a.head_dim, kv_hidden = a.kv_heads * a.head_dim;
    const u64 width = hidden + 2 * kv_hidden;
    const u64 column = part == 0 ? 0 : hidden + (part - 1) * kv_hidden;
    return (b * a.seq + t) * width + column + head * a.head_dim;
}

__device__ __forceinline__ u64 out_at(AttnShape a, u64 b, u64 t, u64 head) {
    return (b * a.seq + t) * a.heads * a.head_dim + head * a.head_dim;
}

__device__ __forceinline__ u64 row_at(AttnShape a, u64 b, u64 head, u64 t) {
    return (b * a.heads + head) * a.seq + t;
}

// The first key row t of sequence b sees: its document's start.
__device__ __forceinline__ u64 first_key(AttnShape a, const unsigned *ids, u64 b, u64 t) {
    return ids ? t - min((u64)ids[b * a.seq + t], t) : 0;
}

// The smallest `value` over the block (blockDim.x a multiple of 32, at
// most 1024), every thread gets it.
__device__ u64 block_min(u64 value) {
    __shared__ u64 warps[32];
    for (int offset = 16; offset > 0; offset /= 2) {
        value = min(value, __shfl_xor_sync(0xffffffffu, value, offset));
    }
    if (threadIdx.x % 32 == 0) {
        warps[threadIdx.x / 32] = value;
    }
    __syncthreads();
    u64 total = warps[0];
    for (unsigned w = 1; w < blockDim.x / 32; ++w) {
        total = min(total, warps[w]);
    }
    __syncthreads();
    return total;
}

// grid (ceil(seq / ATTN_ROWS), heads, batch), ATTN_ROWS threads.
template <typename T>
__device__ void attention_forward(AttnShape a, const unsigned *ids, const T *qkv, T *out,
                                  float *lse) {
    __shared__ float keys[ATTN_TILE * HEAD_DIM_MAX];
    __shared__ float vals[ATTN_TILE * HEAD_DIM_MAX];
    const u64 head = blockIdx.y, b = blockIdx.z, d = a.head_dim;
    const u64 kv_head = head / (a.heads / a.kv_heads);
    const u64 first = (u64)blockIdx.x * ATTN_ROWS;
    const u64 t = first + threadIdx.x;
    const bool live = t < a.seq;
    const u64 start = live ? first_key(a, ids, b, t) : ~0ull;
    const float scale = 1.0f / sqrtf((float)d);
    float q[HEAD_DIM_MAX], acc[HEAD_DIM_MAX];
    for (u64 c = 0; c < d; ++c) {
        q[c] = live ? load(qkv, qkv_at(a, b, t, 0, head) + c) : 0.0f;
        acc[c] = 0.0f;
    }
    float max = -__int_as_float(0x7f800000), sum = 0.0f;
    const u64 last = min(first + ATTN_ROWS, a.seq) - 1;
    // The tiles from the one holding the block's earliest key.
    const u64 earliest = block_min(start);
    for (u64 j0 = earliest - earliest % ATTN_TILE; j0 <= last; j0 += ATTN_TILE) {
        const u64 tile = min((u64)ATTN_TILE, a.seq - j0);
        for (u64 e = threadIdx.x; e < tile * d; e += ATTN_ROWS) {
            const u64 j = j0 + e / d, c = e % d;
            keys[e] = load(qkv, qkv_at(a, b, j, 1, kv_head) + c);
            vals[e] = load(qkv, qkv_at(a, b, j, 2, kv_head) + c);
        }
        __syncthreads();
        for (u64 jj = 0; live && jj < tile && j0 + jj <= t; ++jj) {
            if (j0 + jj < start) {
                continue;
            }
            float score = 0.0f;
            for (u64 c = 0; c < d; ++c) {
                score += q[c] * keys[jj * d + c];
            }
            score *= scale;
            const float next = fmaxf(max, score);
            const float keep = expf(max - next), weight = expf(score - next);
            for (u64 c = 0; c < d; ++c) {
                acc[c] = acc[c] * keep + weight * vals[jj * d + c];
            }
            sum = sum * keep + weight;
            max = next;
        }
        __syncthreads();
    }
    if (live) {
        for (u64 c = 0; c < d; ++c) {
            store(out, out_at(a, b, t, head) + c, acc[c] / sum);
        }
        lse[row_at(a, b, head, t)] = max + logf(sum);
    }
}

// The backward's first pass, one thread per query row: each row's
// D = sum_j p_ij dp_ij into `dsum`, then dq. grid and block as forward.
template <typename T>
__device__ void attention_backward_dq(AttnShape a, const unsigned *ids, const T *qkv,
                                      const float *lse, const T *dout, T *dqkv, float *dsum) {
    const u64 head = blockIdx.y, b = blockIdx.z, d = a.head_dim;
    const u64 kv_head = head / (a.heads / a.kv_heads);
    const u64 t = (u64)blockIdx.x * ATTN_ROWS + threadIdx.x;
    if (t >= a.seq) {
        return;
    }
    const float scale = 1.0f / sqrtf((float)d);
    const float row_lse = lse[row_at(a, b, head, t)];
    float q[HEAD_DIM_MAX], o[HEAD_DIM_MAX], dq[HEAD_DIM_MAX];
    for (u64 c = 0; c < d; ++c) {
        q[c] = load(qkv, qkv_at(a, b, t, 0, head) + c);
        o[c] = load(dout, out_at(a, b, t, head) + c);
        dq[c] = 0.0f;
    }
    float total = 0.0f;
    const u64 start = first_key(a, ids, b, t);
    for (int pass = 0; pass < 2; ++pass) {
        for (u64 j = start; j <= t; ++j) {
            const u64 k_at = qkv_at(a, b, j, 1, kv_head), v_at = qkv_at(a, b, j, 2, kv_head);
            float score = 0.0f, dp = 0.0f;
            for (u64 c = 0; c < d; ++c) {
                score += q[c] * load(qkv, k_at + c);
                dp += o[c] * load(qkv, v_at + c);
            }
            const float p = expf(score * scale - row_lse);
            if (pass == 0) {
                total += p * dp;
            } else {
                const float ds = p * (dp - total) * scale;
                for (u64 c = 0; c < d; ++c) {
                    dq[c] += ds * load(qkv, k_at + c);
                }
            }
        }
    }
    for (u64 c = 0; c < d; ++c) {
        store(dqkv, qkv_at(a, b, t, 0, head) + c, dq[c]);
    }
    dsum[row_at(a, b, head, t)] = total;
}

// The backward's second pass, one thread per key row of a key/value head:
// dk and dv, from the queries of every query head it serves that see it,
// heads then rows in order (no atomics: each thread owns its rows).
// grid (ceil(seq / ATTN_ROWS), kv_heads, batch), ATTN_ROWS threads.
template <typename T>
__device__ void attention_backward_dkv(AttnShape a, const unsigned *ids, const T *qkv,
                                       const float *lse, const T *dout, const float *dsum,
                                       T *dqkv) {
    const u64 kv_head = blockIdx.y, b = blockIdx.z, d = a.head_dim;
    const u64 group = a.heads / a.kv_heads;
    const u64 j = (u64)blockIdx.x * ATTN_ROWS + threadIdx.x;
    if (j >= a.seq) {
        return;
    }
    const float scale = 1.0f / sqrtf((float)d);
    float k[HEAD_DIM_MAX], v[HEAD_DIM_MAX], dk[HEAD_DIM_MAX], dv[HEAD_DIM_MAX];
    for (u64 c = 0; c < d; ++c) {
        k[c] = load(qkv, qkv_at(a, b, j, 1, kv_head) + c);
        v[c] = load(qkv, qkv_at(a, b, j, 2, kv_head) + c);
        dk[c] = 0.0f;
        dv[c] = 0.0f;
    }
    for (u64 head = kv_head * group; head < (kv_head + 1) * group; ++head) {
        for (u64 t = j; t < a.seq; ++t) {
            if (first_key(a, ids, b, t) > j) {
                continue;
            }
            const u64 q_at = qkv_at(a, b, t, 0, head), o_at = out_at(a, b, t, head);
            float score = 0.0f, dp = 0.0f;
            for (u64 c = 0; c < d; ++c) {
                score += load(qkv, q_at + c) * k[c];
                dp += load(dout, o_at + c) * v[c];
            }
            const u64 row = row_at(a, b, head, t);
            const float p = expf(score * scale - lse[row]);
            const float ds = p * (dp - dsum[row]) * scale;
            for (u64 c = 0; c < d; ++c) {
                dv[c] += p * load(dout, o_at + c);
                dk[c] += ds * load(qkv, q_at + c);
            }
        }
    }
    for (u64 c = 0; c < d; ++c) {
        store(dqkv, qkv_at(a, b, j, 1, kv_head) + c, dk[c]);
        store(dqkv, qkv_at(a, b, j, 2, kv_head) + c, dv[c]);
    }
}

#define FOR_EACH_DTYPE(MACRO) MACRO(f32, float) MACRO(bf16, bf16_t)

#define ELEMENTWISE(NAME, T)                                                                      \
    extern "C" __global__ void gelu_##NAME(const T *x, T *out, u64 n) { gelu(x, out, n); }        \
    extern "C" __global__ void gelu_backward_##NAME(const T *dout, const T *x, T *dx, u64 n) {    \
        gelu_backward(dout, x, dx, n);                                                            \
    }                                                                                             \
    extern "C" __global__ void add_##NAME(T *y, const T *x, u64 n) { add(y, x, n); }              \
    extern "C" __global__ void axpy_##NAME(float alpha, const T *x, T *y, u64 n) {                \
        axpy(alpha, x, y, n);                                                                     \
    }                                                                                             \
    extern "C" __global__ void scale_##NAME(float alpha, T *x, u64 n) { scale(alpha, x, n); }     \
    extern "C" __global__ void add_bias_##NAME(T *x, const float *bias, u64 rows, u64 cols) {     \
        add_bias(x, bias, rows, cols);                                                            \
    }                                                                                             \
    extern "C" __global__ void bias_grad_##NAME(const T *dy, float *dbias, u64 rows, u64 cols) {  \
        bias_grad(dy, dbias, rows, cols);                                                         \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK) layer_norm_##NAME(                        \
        const T *x, const float *gamma, const float *beta, T *out, float *mean, float *rstd,      \
        u64 rows, u64 cols, float eps) {                                                          \
        layer_norm(x, gamma, beta, out, mean, rstd, rows, cols, eps);                             \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK) layer_norm_backward_dx_##NAME(            \
        const T *dout, const T *x, const float *gamma, const float *mean, const float *rstd,      \
        T *dx, u64 rows, u64 cols) {                                                              \
        layer_norm_backward_dx(dout, x, gamma, mean, rstd, dx, rows, cols);                       \
    }                                                                                             \
    extern "C" __global__ void layer_norm_backward_params_##NAME(                                 \
        const T *dout, const T *x, const float *mean, const float *rstd, float *dgamma,           \
        float *dbeta, u64 rows, u64 cols) {                                                       \
        layer_norm_backward_params(dout, x, mean, rstd, dgamma, dbeta, rows, cols);               \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK) cross_entropy_##NAME(                     \
        const T *logits, const unsigned *targets, u64 rows, u64 vocab, float grad_scale,          \
        T *dlogits, float *row_loss, u64 *bad) {                                                  \
        cross_entropy(logits, targets, rows, vocab, grad_scale, dlogits, row_loss, bad);          \
    }                                                                                             \
    extern "C" __global__ void embedding_##NAME(                                                  \
        const float *table, const float *positions, const unsigned *tokens, const unsigned *ids,  \
        u64 count, u64 seq, u64 hidden, u64 vocab, T *out, u64 *bad) {                            \
        embedding(table, positions, tokens, ids, count, seq, hidden, vocab, out, bad);            \
    }                                                                                             \
    extern "C" __global__ void embedding_backward_##NAME(                                         \
        const unsigned *tokens, const unsigned *ids, u64 count, u64 seq, u64 hidden, u64 vocab,   \
        const T *dout, float *dtable, float *dpositions) {                                        \
        embedding_backward(tokens, ids, count, seq, hidden, vocab, dout, dtable, dpositions);     \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK) rms_norm_##NAME(                          \
        const T *x, const float *gamma, T *out, float *rstd, u64 rows, u64 cols, float eps) {     \
        rms_norm(x, gamma, out, rstd, rows, cols, eps);                                           \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK) rms_norm_backward_dx_##NAME(              \
        const T *dout, const T *x, const float *gamma, const float *rstd, T *dx, u64 rows,        \
        u64 cols) {                                                                               \
        rms_norm_backward_dx(dout, x, gamma, rstd, dx, rows, cols);                               \
    }                                                                                             \
    extern "C" __global__ void rms_norm_backward_gamma_##NAME(                                    \
        const T *dout, const T *x, const float *rstd, float *dgamma, u64 rows, u64 cols) {        \
        rms_norm_backward_gamma(dout, x, rstd, dgamma, rows, cols);                               \
    }                                                                                             \
    extern "C" __global__ void rotary_##NAME(T *qkv, const unsigned *ids, const float *inv_freq,  \
                                             u64 rows, u64 seq, u64 width, u64 turned, u64 half,  \
                                             float sign) {                                        \
        rotary(qkv, ids, inv_freq, rows, seq, width, turned, half, sign);                         \
    }                                                                                             \
    extern "C" __global__ void swiglu_##NAME(const T *gate_up, T *out, u64 rows, u64 f) {         \
        swiglu(gate_up, out, rows, f);                                                            \
    }                                                                                             \
    extern "C" __global__ void swiglu_backward_##NAME(const T *dout, const T *gate_up,            \
                                                      T *dgate_up, u64 rows, u64 f) {             \
        swiglu_backward(dout, gate_up, dgate_up, rows, f);                                        \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(BLOCK)                                           \
        sum_squares_partials_##NAME(const T *x, u64 n, double *partials) {                        \
        sum_squares_partials(x, n, partials);                                                     \
    }                                                                                             \
    extern "C" __global__ void non_finite_##NAME(const T *x, u64 n, unsigned *flag) {             \
        non_finite(x, n, flag);                                                                   \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(ATTN_ROWS)                                       \
        attention_forward_##NAME(AttnShape a, const unsigned *ids, const T *qkv, T *out,          \
                                 float *lse) {                                                    \
        attention_forward(a, ids, qkv, out, lse);                                                 \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(ATTN_ROWS) attention_backward_dq_##NAME(         \
        AttnShape a, const unsigned *ids, const T *qkv, const float *lse, const T *dout, T *dqkv, \
        float *dsum) {                                                                            \
        attention_backward_dq(a, ids, qkv, lse, dout, dqkv, dsum);                                \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(ATTN_ROWS) attention_backward_dkv_##NAME(        \
        AttnShape a, const unsigned *ids, const T *qkv, const float *lse, const T *dout,          \
        const float *dsum, T *dqkv) {                                                             \
        attention_backward_dkv(a, ids, qkv, lse, dout, dsum, dqkv);                               \
    }

FOR_EACH_DTYPE(ELEMENTWISE)

extern "C" __global__ void cast_f32_bf16(const float *x, bf16_t *y, u64 n) { cast(x, y, n); }
extern "C" __global__ void cast_bf16_f32(const bf16_t *x, float *y, u64 n) { cast(x, y, n); }

// The second pass of a sum: one block of BLOCK threads sums `count`
// partials in a fixed order into *out.
extern "C" __global__ void __launch_bounds__(BLOCK)
    sum_partials(const double *partials, unsigned count, double *out) {
    __shared__ double scratch[BLOCK];
    double sum = 0.0;
    for (unsigned i = threadIdx.x; i < count; i += BLOCK) {
        sum += partials[i];
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        *out = sum;
    }
}

// The mean of `n` fp32 values (the rows' losses) into *out, in fp64, by
// one block of BLOCK threads in a fixed order.
extern "C" __global__ void __launch_bounds__(BLOCK)
    mean_f32(const float *x, u64 n, double *out) {
    __shared__ double scratch[BLOCK];
    double sum = 0.0;
    for (u64 i = threadIdx.x; i < n; i += BLOCK) {
        sum += (double)x[i];
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        *out = sum / (double)n;
    }
}

// strata_optim's AdamCoefficients, field for field (#[repr(C)] there).
struct AdamCoefficients {
    float grad_scale;
    float l2;
    float decay;
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float inv_sqrt_bias_correction2;
    float eps;
    float neg_step_size;
};

// x, or +0 where its exponent field is zero (a subnormal or a zero): the
// rule strata_optim reads moments by (its `flush_subnormal`), kept here so
// that resident and offloaded states step alike.
__device__ __forceinline__ float flush_subnormal(float x) {
    return (__float_as_uint(x) & 0x7f800000u) ? x : 0.0f;
}

// One AdamW step over states resident on the device: fp32 gradient in,
// fp32 master and moments updated in place, the bf16 compute copy out.
// The arithmetic is strata_optim's vector kernel's, fused where it fuses.
extern "C" __global__ void adamw_bf16(AdamCoefficients k, const float *grad, float *master,
                                      float *m, float *v, bf16_t *param, u64 n) {
    for (u64 i = first_index(); i < n; i += grid_stride()) {
        // v as it is where eps is below strata_optim's FLUSH_V_EPS_MIN.
        float p0 = master[i], m0 = flush_subnormal(m[i]);
        float v0 = k.eps >= 1e-12f ? flush_subnormal(v[i]) : v[i];
        float g = __fmaf_rn(k.l2, p0, grad[i] * k.grad_scale);
        float m1 = __fmaf_rn(k.one_minus_beta1, g - m0, m0);
        float v1 = __fmaf_rn(g * g, k.one_minus_beta2, v0 * k.beta2);
        float denominator = __fmaf_rn(__fsqrt_rn(v1), k.inv_sqrt_bias_correction2, k.eps);
        float p1 = __fmaf_rn(k.neg_step_size, __fdiv_rn(m1, denominator), p0 * k.decay);
        master[i] = p1;
        m[i] = m1;
        v[i] = v1;
        param[i] = f32_to_bf16(p1);
    }
}
