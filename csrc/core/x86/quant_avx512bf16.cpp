// Quantized tiles of this ISA (see ../quant.h). Not written yet: no format has tiles here.
#include "../quant.h"

namespace cpumoe {

const QuantKernel* quant_x86_avx512bf16(QuantFormat) { return nullptr; }

}  // namespace cpumoe
