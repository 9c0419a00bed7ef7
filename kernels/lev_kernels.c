/* LEV's spline product on CPU, forward and backward, as plain C loops: SplineProduct's function
   (kernels/fast_lev.py; its torch kernels are log_mode_chunk and log_mode_chunk_backward), in the loop
   order a CPU wants, which torch.compile cannot express:
     - forward: each mode's product over the d_seed factors is kept as a mantissa in [1, 2) and a binary
       exponent, renormalised every gcd(d_seed, 8) factors (where the torch kernel takes a log) by reading the
       float's bits, so a mode costs no log and no exp; a mode whose running product leaves the normal range
       (0, subnormal, inf, NaN) is redone with one log per factor, and one beyond the normal range at the end
       goes through ldexp (which rounds it to a subnormal, 0 or inf, as exp does in the torch kernel);
     - backward: blocks of up to 64 seed dimensions of one head, each block on one thread, so that dL/dS
       accumulates the 3 non-zero knots of each id in place, without the torch kernel's dense basis (6x the
       multiplications) and without atomics. (h = 1 with d_seed <= 64 is one block: one thread.)
   kernels/c_kernels.py builds it on first use with the system's C compiler, with OpenMP where it has it (then
   it shares torch's OpenMP runtime and threads), and passes the number of threads. Shapes, all contiguous,
   one dtype: t (U, H, D) unit coordinates in [0, 1]; S (H*D, K+2, R) spline coefficients with a zero knot
   at each end; M (U, H, R) modes; G (U, H, R) = dL/dM * M; grad_t (U, H, D); grad_S (H*D, K+2, R), zeroed
   by the caller. */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* fast_lev.py's bspline_weights3 for n coordinates t: the nearest knot j (rint: ties to even, as torch.round),
   the weights of knots j-1, j, j+1 and their derivatives; with normalize, knots outside [0, K-1] get weight 0 and
   the weights are divided by their sum. Branch-free, so that the compiler vectorises it. */
#define WEIGHTS(T, SUFFIX)                                                                        \
static void weights_##SUFFIX(const T *restrict t, int64_t n, int64_t K, int normalize,            \
                             int64_t *restrict j, T *restrict w0, T *restrict w1, T *restrict w2, \
                             T *restrict dw0, T *restrict dw1, T *restrict dw2) {                  \
    const T last = (T)(K - 1);                                                                    \
    _Pragma("omp simd")                                                                           \
    for (int64_t i = 0; i < n; i++) {                                                             \
        T s = t[i] * last, jf = rint(s), f = s - jf;                                              \
        jf = jf > 0 ? (jf < last ? jf : last) : 0;  /* t in [0, 1]; outside, NaN too, no read outside S */ \
        T a = (T)0.5 * ((T)0.5 - f) * ((T)0.5 - f), b = (T)0.75 - f * f, c = (T)0.5 * ((T)0.5 + f) * ((T)0.5 + f); \
        T da = (f - (T)0.5) * last, db = (T)-2.0 * f * last, dc = ((T)0.5 + f) * last;            \
        if (normalize) {                                                                          \
            T has_a = jf - 1 >= 0 ? (T)1 : (T)0, has_c = jf + 1 <= last ? (T)1 : (T)0;             \
            a *= has_a; da *= has_a; c *= has_c; dc *= has_c;                                     \
            T W = a + b + c, dW = da + db + dc;                                                   \
            a = a / W; b = b / W; c = c / W;                                                      \
            da = (da - a * dW) / W; db = (db - b * dW) / W; dc = (dc - c * dW) / W;               \
        }                                                                                         \
        j[i] = (int64_t)jf;                                                                       \
        w0[i] = a; w1[i] = b; w2[i] = c; dw0[i] = da; dw1[i] = db; dw2[i] = dc;                   \
    }                                                                                             \
}

/* One type's pair of kernels. UINT: the unsigned integer of T's width; MANT_BITS, EXP_MAX: its mantissa width
   and the all-ones exponent field; BIAS: the exponent bias. BLOCK: seed dimensions walked together (the
   weights of a row of t are computed for them at once, and their S and dL/dS stay in L2). */
#define BLOCK 64
#define LEV_KERNELS(T, SUFFIX, UINT, MANT_BITS, EXP_MAX, BIAS)                                    \
WEIGHTS(T, SUFFIX)                                                                                \
                                                                                                  \
/* the mode of id u, head h, by per-factor logs: the slow path for modes that left the normal range */ \
static void mode_by_logs_##SUFFIX(const T *t_uh, const T *S_h, T *M_uh, int64_t D, int64_t K,     \
                                  int64_t R, int normalize) {                                     \
    T log_abs[R], neg[R];                                                                         \
    for (int64_t r = 0; r < R; r++) { log_abs[r] = 0; neg[r] = 0; }                                \
    for (int64_t d = 0; d < D; d++) {                                                             \
        int64_t j; T w0, w1, w2, dw[3];                                                           \
        weights_##SUFFIX(t_uh + d, 1, K, normalize, &j, &w0, &w1, &w2, dw, dw + 1, dw + 2);        \
        const T *s = S_h + (d * (K + 2) + j) * R;                                                 \
        for (int64_t r = 0; r < R; r++) {                                                         \
            T phi = w0 * s[r] + w1 * s[R + r] + w2 * s[2 * R + r];                                \
            log_abs[r] += log(fabs(phi));                                                         \
            neg[r] += phi < 0;                                                                    \
        }                                                                                         \
    }                                                                                             \
    for (int64_t r = 0; r < R; r++)                                                               \
        M_uh[r] = (fmod(neg[r], 2) == 1 ? -1 : 1) * exp(log_abs[r]);                              \
}                                                                                                 \
                                                                                                  \
/* the mode of id u, head h: M_uh = prod_d phi[u, h, d, :], renormalised every `group` factors. Inlined into  \
   the callers below with R = 64 (the paper's r) as a constant, which the compiler unrolls, or as it comes. */ \
static inline __attribute__((always_inline)) void mode_##SUFFIX(const T *t_uh, const T *S_h, T *M_uh,      \
        int64_t D, int64_t K, int64_t R, int normalize, int64_t group) {                          \
    T mant[R], w0[D], w1[D], w2[D], dw0[D], dw1[D], dw2[D]; int64_t expo[R], j[D]; int bad[R];      \
    weights_##SUFFIX(t_uh, D, K, normalize, j, w0, w1, w2, dw0, dw1, dw2);                        \
    for (int64_t r = 0; r < R; r++) { mant[r] = 1; expo[r] = 0; bad[r] = 0; }                      \
    for (int64_t d = 0; d < D; d++) {                                                             \
        const T *s = S_h + (d * (K + 2) + j[d]) * R, a = w0[d], b = w1[d], c = w2[d];             \
        _Pragma("omp simd")                                                                       \
        for (int64_t r = 0; r < R; r++)                                                           \
            mant[r] *= a * s[r] + b * s[R + r] + c * s[2 * R + r];                                \
        if (d % group == group - 1) {  /* mant = m 2^e, m in [1, 2): keep m, add e */             \
            _Pragma("omp simd")                                                                   \
            for (int64_t r = 0; r < R; r++) {                                                     \
                UINT bits; memcpy(&bits, &mant[r], sizeof bits);                                  \
                int64_t field = (int64_t)((bits >> MANT_BITS) & EXP_MAX);                         \
                bad[r] |= (field == 0) | (field == EXP_MAX);                                      \
                expo[r] += field - BIAS;                                                          \
                bits = (bits & ~((UINT)EXP_MAX << MANT_BITS)) | ((UINT)BIAS << MANT_BITS);         \
                memcpy(&mant[r], &bits, sizeof bits);                                             \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    int any_bad = 0, any_extreme = 0;                                                             \
    _Pragma("omp simd reduction(|:any_bad, any_extreme)")                                         \
    for (int64_t r = 0; r < R; r++) {  /* M = mant 2^expo: expo into mant's exponent field */     \
        UINT bits; memcpy(&bits, &mant[r], sizeof bits);                                          \
        int64_t field = expo[r] + BIAS;                                                           \
        any_bad |= bad[r];                                                                        \
        any_extreme |= (field < 1) | (field > EXP_MAX - 1);                                       \
        bits = (bits & ~((UINT)EXP_MAX << MANT_BITS)) | ((UINT)(field & EXP_MAX) << MANT_BITS);   \
        memcpy(&M_uh[r], &bits, sizeof bits);                                                     \
    }                                                                                             \
    if (any_extreme)  /* beyond T's normal range: ldexp rounds to a subnormal, 0 or inf */        \
        for (int64_t r = 0; r < R; r++)                                                           \
            M_uh[r] = ldexp(mant[r], (int)(expo[r] > 100000 ? 100000 : expo[r] < -100000 ? -100000 : expo[r])); \
    if (any_bad) mode_by_logs_##SUFFIX(t_uh, S_h, M_uh, D, K, R, normalize);                       \
}                                                                                                 \
                                                                                                  \
/* M[u, h, :] = prod_d phi[u, h, d, :] for all U ids; threads split the ids */                      \
void lev_forward_##SUFFIX(const T *t, const T *S, T *M, int64_t U, int64_t H, int64_t D, int64_t K, \
                          int64_t R, int normalize, int threads) {                                \
    /* renormalise every gcd(D, 8) factors, where the torch kernel takes its logs */               \
    int64_t group = D % 8 == 0 ? 8 : D % 4 == 0 ? 4 : D % 2 == 0 ? 2 : 1;                         \
    for (int64_t h = 0; h < H; h++) {  /* heads outside: one head's S (D x (K+2) x R) stays in L2 */ \
        const T *S_h = S + h * D * (K + 2) * R;                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                         \
        for (int64_t u = 0; u < U; u++) {                                                         \
            const T *t_uh = t + (u * H + h) * D;                                                  \
            T *M_uh = M + (u * H + h) * R;                                                        \
            if (R == 64) mode_##SUFFIX(t_uh, S_h, M_uh, D, K, 64, normalize, group);               \
            else mode_##SUFFIX(t_uh, S_h, M_uh, D, K, R, normalize, group);                       \
        }                                                                                         \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* the backward of one block of n <= BLOCK seed dimensions first..first+n-1 of head h, starting at d0 */ \
static inline __attribute__((always_inline)) void backward_block_##SUFFIX(const T *t, const T *S,          \
        const T *G, T *grad_t, T *grad_S, int64_t U, int64_t H, int64_t D, int64_t K, int64_t R,  \
        int normalize, int64_t h, int64_t d0, int64_t n) {                                        \
    T w0[BLOCK], w1[BLOCK], w2[BLOCK], dw0[BLOCK], dw1[BLOCK], dw2[BLOCK]; int64_t j[BLOCK];        \
    int64_t first = h * D + d0;                                                                   \
    for (int64_t u = 0; u < U; u++) {                                                             \
        const T *g = G + (u * H + h) * R;                                                         \
        weights_##SUFFIX(t + (u * H + h) * D + d0, n, K, normalize, j, w0, w1, w2, dw0, dw1, dw2); \
        for (int64_t i = 0; i < n; i++) {                                                         \
            const T *s0 = S + ((first + i) * (K + 2) + j[i]) * R, *s1 = s0 + R, *s2 = s1 + R;      \
            T *gs0 = grad_S + ((first + i) * (K + 2) + j[i]) * R, *gs1 = gs0 + R, *gs2 = gs1 + R;  \
            T a = w0[i], b = w1[i], c = w2[i], da = dw0[i], db = dw1[i], dc = dw2[i], gt = 0;     \
            _Pragma("omp simd reduction(+:gt)")                                                   \
            for (int64_t r = 0; r < R; r++) {                                                     \
                T grad_phi = g[r] / (a * s0[r] + b * s1[r] + c * s2[r]);                          \
                gs0[r] += a * grad_phi;                                                           \
                gs1[r] += b * grad_phi;                                                           \
                gs2[r] += c * grad_phi;                                                           \
                gt += grad_phi * (da * s0[r] + db * s1[r] + dc * s2[r]);                          \
            }                                                                                     \
            grad_t[(u * H + h) * D + d0 + i] = gt;                                                \
        }                                                                                         \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
/* dL/dt and dL/dS of all seed dimensions from G = dL/dM * M, in blocks of BLOCK dimensions of one head:     \
   dL/dphi = G / phi;  dL/dt = sum_r dL/dphi * sum_m dw_m s_m;  dL/dS[knot j-1+m] += w_m dL/dphi.     \
   Threads split the blocks, and each block's dL/dS belongs to one thread: no two write the same place. */ \
void lev_backward_##SUFFIX(const T *t, const T *S, const T *G, T *grad_t, T *grad_S, int64_t U,  \
                           int64_t H, int64_t D, int64_t K, int64_t R, int normalize, int threads) { \
    int64_t per_head = (D + BLOCK - 1) / BLOCK;                                                   \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
    for (int64_t block = 0; block < H * per_head; block++) {                                      \
        int64_t h = block / per_head, d0 = block % per_head * BLOCK;                              \
        int64_t n = D - d0 < BLOCK ? D - d0 : BLOCK;                                              \
        if (R == 64) backward_block_##SUFFIX(t, S, G, grad_t, grad_S, U, H, D, K, 64, normalize, h, d0, n); \
        else backward_block_##SUFFIX(t, S, G, grad_t, grad_S, U, H, D, K, R, normalize, h, d0, n); \
    }                                                                                             \
}

LEV_KERNELS(float, f32, uint32_t, 23, 0xff, 127)
LEV_KERNELS(double, f64, uint64_t, 52, 0x7ff, 1023)
