/*
 * One chunk of the CPU pass: the sum of squares and NaN/Inf counts of up to kChunkElements
 * elements of one gradient, in exactly the order element_ops.h defines for the CUDA kernel (lanes,
 * then each GPU thread's slots pairwise, then the 256-way tree), so both give the same bits.
 *
 * Two passes compute that same sum:
 *  - inspect_chunk_masked(): every element through the exponent-bit test; non-finite elements add
 *    0 to their lane and are counted. The reference, and what a chunk with NaN/Inf needs.
 *  - inspect_chunk(): first a pass with no per-element test or count, which is all a finite chunk
 *    needs: for finite elements the masked value is the value itself, and the square of the sign
 *    (sign-free value) is the same. A NaN or Inf element (fp32, bf16, fp64) makes its lane and so
 *    the chunk's sum non-finite, since squares are >= 0 and Inf - Inf never occurs; fp16 (read
 *    as magnitudes) keeps an OR of exponent tests instead. A chunk that comes out non-finite is
 *    run again through inspect_chunk_masked(), which also gives an overflowed sum its exact bits.
 *
 * The fast pass reads 16-bit elements as 32-bit words (bf16: the low element shifted into the
 * high half, the high element masked, both reinterpreted as fp32) and keeps lane accumulators in
 * planes (lane k in plane k % 2, word k / 2): where a lane is stored does not change its adds.
 * It adds kRowsPerPass rows per visit of the lanes, starting from the first rows' squares rather
 * than from zero (0.0 + x == x for x >= +0), and a chunk of fewer than 256 packets skips the tree
 * levels that would only add zeros.
 *
 * CPU only, torch-free; every function is inlined into the caller's target clone.
 */
#pragma once

#include <cstdint>
#include <cstring>

#include "csrc/inspect/element_ops.h"

namespace stepguard {
namespace inspect {

/// NaN elements among `n` (taken only for a chunk that holds non-finite values).
template <GradDtype DT>
inline std::int64_t count_nan(const typename Element<DT>::Bits* p, std::int64_t n) {
  std::int64_t nan = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    nan += (p[i] & Element<DT>::kMagnitudeMask) > Element<DT>::kInfBits ? 1 : 0;
  }
  return nan;
}

/// The reference pass over one chunk: `n` elements starting at `p` (the chunk's first element,
/// at a multiple of lanes_per_row within its tensor). The hot loop sums and counts non-finite
/// elements; NaNs are told from Infs in a second look at a chunk that has any. With kScaled
/// false, inv_scale is 1 and its multiply is left out (x * 1.0 == x exactly).
template <GradDtype DT, bool kScaled>
__attribute__((always_inline)) inline ChunkStats inspect_chunk_masked(
    const typename Element<DT>::Bits* p, std::int64_t n, double inv_scale) {
  using E = Element<DT>;
  using Bits = typename E::Bits;
  constexpr int kSlots = kPacketBytes / sizeof(Bits);
  constexpr int kLanes = kThreadsPerChunk * kSlots;
  alignas(64) double lanes[kLanes];
  for (int k = 0; k < kLanes; ++k) lanes[k] = 0.0;
  std::int64_t nonfinite_count = 0;
  for (std::int64_t base = 0; base < n; base += kLanes) {
    const int m = n - base < kLanes ? static_cast<int>(n - base) : kLanes;
    const Bits* row = p + base;
    std::int32_t row_nonfinite = 0;  // 32-bit inside a row keeps the vector lanes narrow
    for (int k = 0; k < m; ++k) {
      const Bits mag = row[k] & E::kMagnitudeMask;
      const Bits finite = mag < E::kInfBits;
      const double x = E::magnitude(mag & static_cast<Bits>(Bits{0} - finite));
      const double v = kScaled ? x * inv_scale : x;
      lanes[k] += v * v;
      row_nonfinite += static_cast<std::int32_t>(1 - finite);
    }
    nonfinite_count += row_nonfinite;
  }
  alignas(64) double per_thread[kThreadsPerChunk];
  for (int t = 0; t < kThreadsPerChunk; ++t) {
    per_thread[t] = combine_slots(lanes + t * kSlots, kSlots);
  }
  ChunkStats out;
  out.sum_squares = tree_sum_threads(per_thread);
  out.nan_count = nonfinite_count > 0 ? count_nan<DT>(p, n) : 0;
  out.inf_count = nonfinite_count - out.nan_count;
  return out;
}

/// How the fast pass reads a dtype: words of kPerWord elements, element k of a row being plane
/// k % kPerWord of word k / kPerWord. value() is the element as double (signed, or for fp16 its
/// magnitude); kSumShowsNonFinite says whether a NaN/Inf element always makes the sum non-finite,
/// else nonfinite() flags one.
template <GradDtype DT>
struct Packed;

/// fp32 and fp64: one element per word, read as itself.
template <typename W>
struct OnePerWord {
  using Word = W;
  static constexpr int kPerWord = 1;
  static constexpr bool kSumShowsNonFinite = true;
  static double value(Word w, int) {
    if constexpr (sizeof(W) == 4) {
      return static_cast<double>(bits_to_f32(w));
    } else {
      return bits_to_f64(w);
    }
  }
  static std::uint32_t nonfinite(Word) { return 0; }
};

template <>
struct Packed<GradDtype::kFloat32> : OnePerWord<std::uint32_t> {};

template <>
struct Packed<GradDtype::kFloat64> : OnePerWord<std::uint64_t> {};

template <>
struct Packed<GradDtype::kBFloat16> {
  using Word = std::uint32_t;
  static constexpr int kPerWord = 2;
  static constexpr bool kSumShowsNonFinite = true;
  // A bf16 is the high half of an fp32: shift the low element up, mask the high one in place.
  static double value(Word w, int plane) {
    return static_cast<double>(bits_to_f32(plane == 0 ? w << 16 : w & 0xffff0000u));
  }
  static std::uint32_t nonfinite(Word) { return 0; }
};

template <>
struct Packed<GradDtype::kFloat16> {
  using Word = std::uint32_t;
  static constexpr int kPerWord = 2;
  static constexpr bool kSumShowsNonFinite = false;  // magnitude() of NaN/Inf bits is finite
  static double value(Word w, int plane) {
    return Element<GradDtype::kFloat16>::magnitude(
        static_cast<std::uint16_t>((w >> (16 * plane)) & 0x7fffu));
  }
  static std::uint32_t nonfinite(Word w) {
    return static_cast<std::uint32_t>((w & 0x7fffu) >= 0x7c00u) |
           static_cast<std::uint32_t>(((w >> 16) & 0x7fffu) >= 0x7c00u);
  }
};

/// Rows added per visit of the lane accumulators: one load and store of a lane per this many
/// rows. A 4,096-element fp32 tensor is one visit.
constexpr int kRowsPerPass = 4;
constexpr int kCacheLine = 64;
/// __builtin_prefetch locality of the rows read next (3: into L1, as the loads that follow).
constexpr int kPrefetchLocality = 3;

template <GradDtype DT>
struct FastChunk {
  using P = Packed<DT>;
  using Word = typename P::Word;
  using Bits = typename Element<DT>::Bits;
  static constexpr int kSlots = kPacketBytes / static_cast<int>(sizeof(Bits));
  static constexpr int kLanes = kThreadsPerChunk * kSlots;
  static constexpr int kWords = kLanes / P::kPerWord;  ///< words per row and lanes per plane
  static constexpr std::int64_t kRowBytes = kThreadsPerChunk * kPacketBytes;

  static Word load(const unsigned char* at) {
    Word w;
    std::memcpy(&w, at, sizeof w);  // 16-bit tensors need only be 2-byte aligned
    return w;
  }

  /// Adds words [j0, j1) of kRows rows to the lanes; kFirst: the lanes start from these rows'
  /// squares.
  template <bool kScaled, int kRows, bool kFirst>
  __attribute__((always_inline)) static std::uint32_t add_words(const unsigned char* rows, int j0,
                                                                int j1, double* lanes,
                                                                double inv_scale) {
    std::uint32_t bad = 0;
    for (int j = j0; j < j1; ++j) {
      Word w[kRows];
      for (int r = 0; r < kRows; ++r) w[r] = load(rows + r * kRowBytes + j * sizeof(Word));
      for (int plane = 0; plane < P::kPerWord; ++plane) {
        double a = kFirst ? 0.0 : lanes[plane * kWords + j];
        for (int r = 0; r < kRows; ++r) {
          const double x = P::value(w[r], plane);
          const double v = kScaled ? x * inv_scale : x;
          a = (kFirst && r == 0) ? v * v : a + v * v;
        }
        lanes[plane * kWords + j] = a;
      }
      if (!P::kSumShowsNonFinite) {
        for (int r = 0; r < kRows; ++r) bad |= P::nonfinite(w[r]);
      }
    }
    return bad;
  }

  /// Adds kRows whole rows to the lanes (kFirst: starting from their squares) and prefetches
  /// `ahead`, the kRows rows the next pass (or the next chunk) reads, a line per row for each line
  /// read: the hardware prefetchers do not run far enough ahead on kRows streams 4 KiB apart.
  template <bool kScaled, int kRows, bool kFirst>
  __attribute__((always_inline)) static void add_rows(const unsigned char* rows,
                                                      std::uintptr_t ahead, double* lanes,
                                                      double inv_scale, std::uint32_t* flag) {
    constexpr int kLineWords = kCacheLine / static_cast<int>(sizeof(Word));
    std::uint32_t bad = 0;
    for (int j = 0; j < kWords; j += kLineWords) {
      for (int r = 0; r < kRows; ++r) {
        const std::uintptr_t line = ahead + r * kRowBytes + j * sizeof(Word);
        __builtin_prefetch(reinterpret_cast<const void*>(line), 0, kPrefetchLocality);
      }
      bad |= add_words<kScaled, kRows, kFirst>(rows, j, j + kLineWords, lanes, inv_scale);
    }
    *flag |= bad;
  }

  /// combine_slots() of GPU thread t, read from the planes. Thread t's slot s is word
  /// t * kQ + s / kPerWord of plane s % kPerWord, so the first levels pair words within a plane
  /// and the last one adds the planes (for 16-bit: slots {0,4} {2,6} {1,5} {3,7} = words {0,2}
  /// {1,3} of each plane, then {0,2}+{1,3}, then plane 0 + plane 1). Written out so the loop over
  /// threads vectorizes.
  static constexpr int kQ = kSlots / P::kPerWord;  ///< a thread's words per plane
  static_assert(kQ == 2 || kQ == 4, "2 or 4 words per thread and plane");
  static double combine_plane(const double* plane, int t) {
    const double* q = plane + t * kQ;
    return kQ == 2 ? q[0] + q[1] : (q[0] + q[2]) + (q[1] + q[kQ - 1]);
  }
  static double combine_thread(const double* lanes, int t) {
    return P::kPerWord == 1 ? combine_plane(lanes, t)
                            : combine_plane(lanes, t) + combine_plane(lanes + kWords, t);
  }

  /// The sum of the chunk, or a non-finite value / *flag set when the masked pass must decide.
  /// `next`: the chunk read after this one (prefetched during the last pass), or null.
  template <bool kScaled>
  __attribute__((always_inline)) static double sum(const unsigned char* p, std::int64_t n,
                                                   double inv_scale, const unsigned char* next,
                                                   std::uint32_t* flag) {
    alignas(64) double lanes[kLanes];
    const std::int64_t whole_rows = n / kLanes;
    const int tail = static_cast<int>(n - whole_rows * kLanes);  // elements of a partial row
    // GPU threads that see data: all of them once a row is whole.
    const int active = whole_rows > 0 ? kThreadsPerChunk : (tail + kSlots - 1) / kSlots;
    int width = 1;  // the tree's widest level that adds anything but zeros, doubled
    while (width < active) width *= 2;

    // What the pass starting at `row` prefetches: the rows after it, or the next chunk once they
    // are the last (a line beyond the chunk is harmless: a prefetch never faults).
    const std::int64_t rows = whole_rows + (tail > 0 ? 1 : 0);
    // Addresses as integers: they may lie past the chunk's end.
    auto ahead = [&](std::int64_t row) {
      return row + kRowsPerPass >= rows && next != nullptr
                 ? reinterpret_cast<std::uintptr_t>(next)
                 : reinterpret_cast<std::uintptr_t>(p) + (row + kRowsPerPass) * kRowBytes;
    };
    std::int64_t row = 0;
    if (whole_rows >= kRowsPerPass) {
      add_rows<kScaled, kRowsPerPass, true>(p, ahead(0), lanes, inv_scale, flag);
      row = kRowsPerPass;
    } else if (whole_rows == 2) {  // a whole 16-bit chunk: both rows in one visit
      add_rows<kScaled, 2, true>(p, ahead(0), lanes, inv_scale, flag);
      row = 2;
    } else if (whole_rows > 0) {
      add_rows<kScaled, 1, true>(p, ahead(0), lanes, inv_scale, flag);
      row = 1;
    } else {
      // Only threads below `width` take part below; zero their lanes.
      const int words = width * kSlots / P::kPerWord;
      for (int plane = 0; plane < P::kPerWord; ++plane) {
        for (int j = 0; j < words; ++j) lanes[plane * kWords + j] = 0.0;
      }
    }
    for (; row + kRowsPerPass <= whole_rows; row += kRowsPerPass) {
      add_rows<kScaled, kRowsPerPass, false>(p + row * kRowBytes, ahead(row), lanes, inv_scale,
                                             flag);
    }
    for (; row < whole_rows; ++row) {
      add_rows<kScaled, 1, false>(p + row * kRowBytes, ahead(row), lanes, inv_scale, flag);
    }
    if (tail > 0) {
      const unsigned char* last = p + whole_rows * kRowBytes;
      const int words = tail / P::kPerWord;
      *flag |= add_words<kScaled, 1, false>(last, 0, words, lanes, inv_scale);
      if (words * P::kPerWord < tail) {  // a 16-bit tensor's odd last element: plane 0
        Bits b;
        std::memcpy(&b, last + words * sizeof(Word), sizeof b);
        const Word w = b;
        const double x = P::value(w, 0);
        const double v = kScaled ? x * inv_scale : x;
        lanes[words] += v * v;
        if (!P::kSumShowsNonFinite) *flag |= P::nonfinite(w);
      }
    }

    alignas(64) double per_thread[kThreadsPerChunk];
    for (int t = 0; t < width; ++t) per_thread[t] = combine_thread(lanes, t);
    // tree_sum_threads() without the levels at or above `width`, which add zeros (x + 0 == x).
    for (int w = width / 2; w > 0; w /= 2) {
      for (int i = 0; i < w; ++i) per_thread[i] += per_thread[i + w];
    }
    return per_thread[0];
  }
};

/// True when `v` is NaN or +/-Inf, by its exponent bits.
inline bool nonfinite_f64(double v) {
  std::uint64_t b;
  std::memcpy(&b, &v, sizeof b);
  return (b & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

/// One chunk on the CPU: the fast pass, and the masked pass for a chunk that holds NaN/Inf or
/// whose sum overflowed. The same bits as inspect_chunk_masked() for every input.
/// Always inlined, so each CPU target clone (AVX-512, AVX2, baseline) compiles its own copy.
template <GradDtype DT, bool kScaled>
__attribute__((always_inline)) inline ChunkStats inspect_chunk(const typename Element<DT>::Bits* p,
                                                               std::int64_t n, double inv_scale,
                                                               const void* next = nullptr) {
  std::uint32_t flag = 0;
  const double sum =
      FastChunk<DT>::template sum<kScaled>(reinterpret_cast<const unsigned char*>(p), n, inv_scale,
                                           static_cast<const unsigned char*>(next), &flag);
  if (flag != 0 || nonfinite_f64(sum)) return inspect_chunk_masked<DT, kScaled>(p, n, inv_scale);
  ChunkStats out;
  out.sum_squares = sum;
  return out;
}

}  // namespace inspect
}  // namespace stepguard
