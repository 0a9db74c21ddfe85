// Attention over a block pool on the CPU (specdec/paged_kernel.py builds and loads this).
//
// Each row's keys and values live in the pool's slots, in the order the row's read list gives them; a task
// (row, a range of key/value heads, a block of queries) walks the row's slots a chunk at a time: it reads the
// chunk's keys and values for its heads straight from the pool where the slots run on (a row's blocks are
// mostly taken together) or copies them into a small buffer where they do not, then runs flash attention's
// online softmax over it (Dao et al., arXiv 2205.14135) with MKL's sgemm, the kernel torch's own CPU
// attention calls, or for a few queries a head with dot products four keys at a time. A chunk's keys and values
// for the task's heads are sized to stay in L2 (fewer keys a chunk the more heads a task reads). Every query head
// of a group shares its key/value head's reads (grouped-query attention).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> Python; torch/extension.h (the whole C++ API) doubles the build
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// MKL's column-major sgemm and its per-thread thread count, which torch's CPU build carries and exports
extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                       const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);
extern "C" int MKL_Set_Num_Threads_Local(int);

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float NEG = -std::numeric_limits<float>::infinity();
constexpr int64_t CHUNK = 256;  // keys a task scores at once, at most
constexpr int64_t CHUNK_FLOATS = 32768;  // a chunk's keys for a task's heads (128 KiB; its values as much): they stay in L2
constexpr int64_t QUERIES = 64;  // query rows (a group's heads x queries) a task takes at most
constexpr int64_t DOT_ROWS = 4;  // up to this many query rows a head: dot products and axpys (memory-bound), not sgemm (measured)

// c [n, m] (row-major) = alpha * a . b (+ c with beta 1), as column-major BLAS sees it
void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char cta = ta ? 'T' : 'N', ctb = tb ? 'T' : 'N';
  const int im = m, in = n, ik = k, ilda = lda, ildb = ldb, ildc = ldc;
  sgemm_(&cta, &ctb, &im, &in, &ik, &alpha, a, &ilda, b, &ildb, &beta, c, &ildc);
}

// s[j] = -inf where !mask[j] -> the largest s[j]
float mask_and_max(float* s, const bool* mask, int64_t n) {
  const __m256 neg = _mm256_set1_ps(NEG);
  __m256 vmax = neg;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 x = _mm256_loadu_ps(s + j);
    uint64_t bits;
    std::memcpy(&bits, mask + j, 8);
    if (bits != 0x0101010101010101ULL) {
      const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask + j)));
      x = _mm256_blendv_ps(neg, x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, _mm256_setzero_si256())));
      _mm256_storeu_ps(s + j, x);
    }
    vmax = _mm256_max_ps(vmax, x);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float r = *std::max_element(lanes, lanes + 8);
  for (; j < n; ++j) {
    if (!mask[j]) s[j] = NEG;
    r = std::max(r, s[j]);
  }
  return r;
}

// s[j] = exp(s[j] - max) -> their sum
float exp_and_sum(float* s, float max, int64_t n) {
  Vec vsum(0.f);
  const Vec vmax(max);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = (Vec::loadu(s + j) - vmax).exp_u20();
    e.store(s + j);
    vsum = vsum + e;
  }
  float lanes[Vec::size()];
  vsum.store(lanes);
  float r = 0.f;
  for (int i = 0; i < Vec::size(); ++i) r += lanes[i];
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - max);
    r += s[j];
  }
  return r;
}

// the sums of a, b, c and d's lanes -> [sum a, sum b, sum c, sum d]
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// s [R, C] = scale * q [R, D] . k^T for R = HR x M query rows, row hi * M + m reading head hi's keys (at k + hi * D,
// a token's heads ld apart): for a few queries (a decode's one), by dot products of each query with four keys at a
// time (their sums reduced together, stored together), the four tokens' heads after one another, where gemms of so
// few rows run far below the memory's speed and head by head would stride through it. D a multiple of 8.
void scores_by_dots(const float* q, int64_t HR, int64_t M, const float* k, int64_t ld, int64_t C, int64_t D,
                    float scale, float* s) {
  const __m128 vscale = _mm_set1_ps(scale);
  int64_t j = 0;
  for (; j + 4 <= C; j += 4)
    for (int64_t hi = 0; hi < HR; ++hi) {
      const float* k0 = k + j * ld + hi * D;
      for (int64_t m = 0; m < M; ++m) {
        const float* qm = q + (hi * M + m) * D;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 x = _mm256_loadu_ps(qm + d);
          a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + d), a0);
          a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + ld + d), a1);
          a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 2 * ld + d), a2);
          a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + 3 * ld + d), a3);
        }
        _mm_storeu_ps(s + (hi * M + m) * C + j, _mm_mul_ps(vscale, sum4(a0, a1, a2, a3)));
      }
    }
  for (; j < C; ++j)
    for (int64_t hi = 0; hi < HR; ++hi) {
      const float* kj = k + j * ld + hi * D;
      for (int64_t m = 0; m < M; ++m) {
        const float* qm = q + (hi * M + m) * D;
        __m256 a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qm + d), _mm256_loadu_ps(kj + d), a);
        s[(hi * M + m) * C + j] = scale * _mm_cvtss_f32(sum4(a, a, a, a));
      }
    }
}

// acc [R, D] += p [R, C] . v, row hi * M + m from head hi's values, four tokens at a time (each accumulator row read
// and written once per four, the sums in the order one by one would take), their heads after one another. D a
// multiple of 8.
void values_by_axpys(const float* p, int64_t HR, int64_t M, const float* v, int64_t ld, int64_t C, int64_t D,
                     float* acc) {
  int64_t j = 0;
  for (; j + 4 <= C; j += 4)
    for (int64_t hi = 0; hi < HR; ++hi) {
      const float* v0 = v + j * ld + hi * D;
      for (int64_t m = 0; m < M; ++m) {
        const float* pm = p + (hi * M + m) * C + j;
        float* am = acc + (hi * M + m) * D;
        if (pm[0] == 0.f && pm[1] == 0.f && pm[2] == 0.f && pm[3] == 0.f) continue;  // masked
        const __m256 p0 = _mm256_set1_ps(pm[0]), p1 = _mm256_set1_ps(pm[1]), p2 = _mm256_set1_ps(pm[2]),
                     p3 = _mm256_set1_ps(pm[3]);
        for (int64_t d = 0; d < D; d += 8) {
          __m256 x = _mm256_loadu_ps(am + d);
          x = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + d), x);
          x = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v0 + ld + d), x);
          x = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v0 + 2 * ld + d), x);
          x = _mm256_fmadd_ps(p3, _mm256_loadu_ps(v0 + 3 * ld + d), x);
          _mm256_storeu_ps(am + d, x);
        }
      }
    }
  for (; j < C; ++j)
    for (int64_t hi = 0; hi < HR; ++hi) {
      const float* vj = v + j * ld + hi * D;
      for (int64_t m = 0; m < M; ++m) {
        const float pj = p[(hi * M + m) * C + j];
        if (pj == 0.f) continue;  // masked
        float* am = acc + (hi * M + m) * D;
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(am + d, _mm256_fmadd_ps(_mm256_set1_ps(pj), _mm256_loadu_ps(vj + d), _mm256_loadu_ps(am + d)));
      }
    }
}

bool any_visible(const bool* mask, int64_t L, int64_t t0, int64_t tn, int64_t c0, int64_t C) {
  for (int64_t t = t0; t < t0 + tn; ++t) {
    const bool* m = mask + t * L + c0;
    if (std::find(m, m + C, true) != m + C) return true;
  }
  return false;
}

}  // namespace

// query [B, Hq, T, D]; pool_k, pool_v [P, Hkv, D]; read [B, L] the pool slots of each row's keys in order;
// mask [B or 1, 1, T, L] bool (true: the query sees the key); queries [B] int64 or empty: row b's real queries are
// its first queries[b], the rest padding, not run (a ragged batch: a prompt's chunk beside trees) -> [B, T, Hq, D]
// (zeros at the padding)
at::Tensor paged_attention(at::Tensor query, at::Tensor pool_k, at::Tensor pool_v, at::Tensor read,
                              at::Tensor mask, double scale, at::Tensor queries) {
  TORCH_CHECK(query.dim() == 4 && pool_k.dim() == 3 && read.dim() == 2 && mask.dim() == 4,
              "paged_attention: query [B, Hq, T, D], pools [P, Hkv, D], read [B, L], mask [B, 1, T, L]");
  TORCH_CHECK(query.scalar_type() == at::kFloat && pool_k.scalar_type() == at::kFloat &&
                  pool_v.scalar_type() == at::kFloat, "paged_attention: float32 only");
  TORCH_CHECK(read.scalar_type() == at::kLong && mask.scalar_type() == at::kBool, "paged_attention: read int64, mask bool");
  TORCH_CHECK(pool_k.sizes() == pool_v.sizes(), "paged_attention: key and value pools differ in shape");
  query = query.contiguous(), read = read.contiguous(), mask = mask.contiguous();
  pool_k = pool_k.contiguous(), pool_v = pool_v.contiguous();
  const int64_t B = query.size(0), Hq = query.size(1), T = query.size(2), D = query.size(3);
  const int64_t P = pool_k.size(0), Hkv = pool_k.size(1), L = read.size(1);
  TORCH_CHECK(pool_k.size(2) == D && Hq % Hkv == 0, "paged_attention: heads or head size do not match the pool");
  TORCH_CHECK(read.size(0) == B && (mask.size(0) == B || mask.size(0) == 1) && mask.size(1) == 1 &&
                  mask.size(2) == T && mask.size(3) == L, "paged_attention: read or mask do not match the query");
  TORCH_CHECK(L == 0 || (read.min().item<int64_t>() >= 0 && read.max().item<int64_t>() < P),
              "paged_attention: a slot outside the pool");
  const bool ragged = queries.numel() > 0;
  TORCH_CHECK(!ragged || (queries.scalar_type() == at::kLong && queries.dim() == 1 && queries.size(0) == B &&
                          queries.min().item<int64_t>() >= 0 && queries.max().item<int64_t>() <= T),
              "paged_attention: queries [B] int64, each in [0, T]");
  queries = queries.contiguous();
  const int64_t* qn = ragged ? queries.data_ptr<int64_t>() : nullptr;
  auto real = [&](int64_t b) { return qn ? qn[b] : T; };  // row b's queries that run
  const int64_t G = Hq / Hkv;
  const int64_t TQ = std::min<int64_t>(T, std::max<int64_t>(1, QUERIES / G)), QB = (T + TQ - 1) / TQ;
  // A task: one row, a range of HR key/value heads, a block of TQ queries and a KS-th of the keys. Reading all of
  // a token's heads together streams through the pool; a batch too small to keep 4 tasks a thread splits its
  // keys (flash decoding's split, merged below), down to 128 keys a split, and only then its heads.
  const int64_t want = 4 * at::get_num_threads(), units = B * QB;
  const int64_t KS = std::max<int64_t>(1, std::min((want + units - 1) / units, L / 128));
  int64_t HR = Hkv;
  while (HR > 1 && units * KS * (Hkv / HR) < want) {
    do --HR; while (Hkv % HR);
  }
  const int64_t HB = Hkv / HR, MQ = G * TQ, span = (L + KS - 1) / std::max<int64_t>(KS, 1);
  const int64_t chunk = std::clamp<int64_t>(CHUNK_FLOATS / (HR * D) / 16 * 16, 32, CHUNK);
  auto out = ragged ? at::zeros({B, T, Hq, D}, query.options()) : at::empty({B, T, Hq, D}, query.options());
  const float* q = query.data_ptr<float>();
  const float* pk = pool_k.data_ptr<float>();
  const float* pv = pool_v.data_ptr<float>();
  const int64_t* rd = read.data_ptr<int64_t>();
  const bool* mk = mask.data_ptr<bool>();
  float* o = out.data_ptr<float>();
  const int64_t mask_rows = mask.size(0), rows = HR * MQ, tasks = B * HB * QB * KS;
  // with split keys, each task's unnormalised output, running max and sum, merged after
  std::vector<float> part_acc(KS > 1 ? tasks * rows * D : 0), part_max(KS > 1 ? tasks * rows : 0),
      part_sum(KS > 1 ? tasks * rows : 0);
  auto place = [&](int64_t b, int64_t h0, int64_t t0, int64_t tn, int64_t r) {  // query row r's output row
    const int64_t M = G * tn, hi = r / M, g = r % M / tn, t = t0 + r % M % tn;
    return o + ((b * T + t) * Hq + (h0 + hi) * G + g) * D;
  };
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int mkl_threads = MKL_Set_Num_Threads_Local(1);  // the tasks are the parallelism
    std::vector<float> kc(chunk * HR * D), vc(chunk * HR * D), s(rows * chunk);
    std::vector<float> qs(rows * D), acc(rows * D), mx(rows), sum(rows);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (HB * QB * KS), h0 = task / (QB * KS) % HB * HR, t0 = task / KS % QB * TQ;
      const int64_t k0 = task % KS * span, k1 = std::min(L, k0 + span);
      if (t0 >= real(b)) continue;  // padding
      const int64_t tn = std::min(TQ, real(b) - t0), M = G * tn;  // query rows per key/value head: [G, tn]
      const bool by_dots = M <= DOT_ROWS && D % 8 == 0;
      for (int64_t hi = 0; hi < HR; ++hi)
        for (int64_t g = 0; g < G; ++g)
          std::memcpy(qs.data() + (hi * M + g * tn) * D, q + ((b * Hq + (h0 + hi) * G + g) * T + t0) * D,
                      tn * D * sizeof(float));
      const int64_t* slots = rd + b * L;
      const bool* rmask = mk + (mask_rows == 1 ? 0 : b) * T * L;
      std::fill(acc.begin(), acc.begin() + HR * M * D, 0.f);
      std::fill(mx.begin(), mx.begin() + HR * M, NEG);
      std::fill(sum.begin(), sum.begin() + HR * M, 0.f);
      for (int64_t c0 = k0; c0 < k1; c0 += chunk) {
        const int64_t C = std::min(chunk, k1 - c0);
        if (!any_visible(rmask, L, t0, tn, c0, C)) continue;  // causal prefill: later chunks
        bool runs_on = true;
        for (int64_t j = 1; j < C && runs_on; ++j) runs_on = slots[c0 + j] == slots[c0] + j;
        const float *kb, *vb;
        int64_t ld;
        if (runs_on) {
          kb = pk + (slots[c0] * Hkv + h0) * D, vb = pv + (slots[c0] * Hkv + h0) * D, ld = Hkv * D;
        } else {
          for (int64_t j = 0; j < C; ++j) {
            const int64_t from = (slots[c0 + j] * Hkv + h0) * D;
            std::memcpy(kc.data() + j * HR * D, pk + from, HR * D * sizeof(float));
            std::memcpy(vc.data() + j * HR * D, pv + from, HR * D * sizeof(float));
          }
          kb = kc.data(), vb = vc.data(), ld = HR * D;
        }
        // s [HR x M, C] = scale * q . k^T, head by head
        if (by_dots)
          scores_by_dots(qs.data(), HR, M, kb, ld, C, D, static_cast<float>(scale), s.data());
        else
          for (int64_t hi = 0; hi < HR; ++hi)
            sgemm(true, false, C, M, D, static_cast<float>(scale), kb + hi * D, ld, qs.data() + hi * M * D, D, 0.f,
                  s.data() + hi * M * C, C);
        for (int64_t r = 0; r < HR * M; ++r) {  // online softmax: s becomes p, acc and the running sums rescale
          float* sr = s.data() + r * C;
          const float top = std::max(mx[r], mask_and_max(sr, rmask + (t0 + r % M % tn) * L + c0, C));
          if (top == NEG) {  // nothing seen yet
            std::fill(sr, sr + C, 0.f);
            continue;
          }
          const float seen = exp_and_sum(sr, top, C), rescale = std::exp(mx[r] - top);
          sum[r] = sum[r] * rescale + seen;
          mx[r] = top;
          if (rescale != 1.f)
            at::vec::map([rescale](Vec x) { return x * Vec(rescale); }, acc.data() + r * D, acc.data() + r * D, D);
        }
        // acc [HR x M, D] += p . v
        if (by_dots)
          values_by_axpys(s.data(), HR, M, vb, ld, C, D, acc.data());
        else
          for (int64_t hi = 0; hi < HR; ++hi)
            sgemm(false, false, D, M, C, 1.f, vb + hi * D, ld, s.data() + hi * M * C, C, 1.f, acc.data() + hi * M * D, D);
      }
      if (KS == 1) {
        for (int64_t r = 0; r < HR * M; ++r) {
          const float total = sum[r], inv = total > 0.f ? 1.f / total : 0.f;  // none seen: zeros
          float* dst = place(b, h0, t0, tn, r);
          for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
        }
      } else {
        std::copy(acc.begin(), acc.begin() + HR * M * D, part_acc.begin() + task * rows * D);
        std::copy(mx.begin(), mx.begin() + HR * M, part_max.begin() + task * rows);
        std::copy(sum.begin(), sum.begin() + HR * M, part_sum.begin() + task * rows);
      }
    }
    MKL_Set_Num_Threads_Local(mkl_threads);
  });
  if (KS > 1)  // merge each unit's splits: rescale every split's sums and outputs to the largest max
    at::parallel_for(0, tasks / KS, 1, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / (HB * QB), h0 = unit / QB % HB * HR, t0 = unit % QB * TQ;
        if (t0 >= real(b)) continue;  // padding
        const int64_t tn = std::min(TQ, real(b) - t0), M = G * tn;
        for (int64_t r = 0; r < HR * M; ++r) {
          float top = NEG;
          for (int64_t k = 0; k < KS; ++k) top = std::max(top, part_max[(unit * KS + k) * rows + r]);
          float* dst = place(b, h0, t0, tn, r);
          std::fill(dst, dst + D, 0.f);
          if (top == NEG) continue;  // none seen: zeros
          float total = 0.f;
          for (int64_t k = 0; k < KS; ++k) {
            const int64_t at = (unit * KS + k) * rows + r;
            if (part_max[at] == NEG) continue;
            const float w = std::exp(part_max[at] - top);
            total += w * part_sum[at];
            const float* a = part_acc.data() + at * D;
            for (int64_t d = 0; d < D; ++d) dst[d] += w * a[d];
          }
          for (int64_t d = 0; d < D; ++d) dst[d] /= total;
        }
      }
    });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over a block pool (CPU, float32)", pybind11::arg("query"),
        pybind11::arg("pool_k"), pybind11::arg("pool_v"), pybind11::arg("read"), pybind11::arg("mask"),
        pybind11::arg("scale"), pybind11::arg("queries") = at::empty({0}, at::kLong));
}
