// SPDX-License-Identifier: MIT
#pragma once
/// attend: exact scaled-dot-product and multi-head attention over Eigen 3.4 tensors, with masks whose meaning
/// is explicit in their types. `#include <attend/attend.hpp>` brings in every public header.

#include "alignment.hpp"
#include "backward.hpp"
#include "cache.hpp"
#include "error.hpp"
#include "interop/torch.hpp"
#include "mask.hpp"
#include "mask_function.hpp"
#include "merge.hpp"
#include "mha.hpp"
#include "mha_backward.hpp"
#include "paged_attention.hpp"
#include "paged_cache.hpp"
#include "position.hpp"
#include "q8_cache.hpp"
#include "score_bias.hpp"
#include "score_function.hpp"
#include "sdpa.hpp"
#include "shape.hpp"
#include "sinks.hpp"
#include "tensor.hpp"
#include "version.hpp"
#include "views.hpp"
