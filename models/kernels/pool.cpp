// Copying whole blocks of a paged key/value pool (models/cache/paged.py): a beam search step whose beams
// share a partly filled last block gives each its own copy before it writes there. A block is K * BS
// consecutive rows of every layer's keys and values, so a copy is one memcpy per layer and kind; as
// torch ops (index tensors, a gather and a scatter) it cost more than the bytes moved.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <unordered_set>

#include "ops.h"

namespace ts {

void copy_blocks(const at::Tensor& pool, const std::vector<int64_t>& src, const std::vector<int64_t>& dst,
                 int64_t block_rows) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.device().is_cpu(),
              "pool must be a contiguous (2, L, rows, D) CPU tensor");
  TORCH_CHECK(src.size() == dst.size(), "copy_blocks needs as many destinations as sources");
  const int64_t planes = pool.size(0) * pool.size(1), rows = pool.size(2);
  const int64_t row_bytes = pool.size(3) * static_cast<int64_t>(pool.element_size());
  const int64_t block_bytes = block_rows * row_bytes, plane_bytes = rows * row_bytes;
  const std::unordered_set<int64_t> read(src.begin(), src.end());
  for (size_t i = 0; i < src.size(); ++i) {
    TORCH_CHECK(src[i] >= 0 && dst[i] >= 0 && (std::max(src[i], dst[i]) + 1) * block_rows <= rows,
                "block ", src[i], " or ", dst[i], " is outside the pool");
    // every source is read as it was before the call: no destination may be a source
    TORCH_CHECK(read.count(dst[i]) == 0, "block ", dst[i], " is both copied from and written");
  }
  char* base = static_cast<char*>(pool.data_ptr());
  for (int64_t p = 0; p < planes; ++p) {
    char* plane = base + p * plane_bytes;
    for (size_t i = 0; i < src.size(); ++i) {
      std::memcpy(plane + dst[i] * block_bytes, plane + src[i] * block_bytes, block_bytes);
    }
  }
}

}  // namespace ts
