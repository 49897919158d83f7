// What every AMX kernel here needs (cpu_amx_linear.h, cpu_prefill_amx.h): Linux's permission to
// use the tile registers and the tile configuration's memory layout. Only on builds whose
// -march=native has AMX-TILE and AMX-BF16 (CPU_AMX_TILES); a CPU without them never sees a tile
// instruction.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CPU_AMX_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace cpu_amx_tiles {

// Linux gives a process AMX's 8 KB of tile state only when it asks (arch_prctl, Linux 5.16+);
// oneDNN asks when it first runs an AMX kernel, which may be after our first call.
inline bool tiles_permitted() {
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
  constexpr int XFEATURE_XTILEDATA = 18;
  static const bool granted =
      syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return granted;
}

// ldtilecfg's 64-byte operand (palette 1): per tile register its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int num_rows, int row_bytes) {
    rows[tile] = uint8_t(num_rows);
    bytes_per_row[tile] = uint16_t(row_bytes);
  }
};

}  // namespace cpu_amx_tiles

#endif
