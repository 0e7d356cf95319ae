// Enums shared by kernels, policies, codecs and the wire format, each with its registry:
//   Selector (how coordinates are chosen): selectors.h;
//   Format and ValueType (how a selection is laid out in a payload): codecs.h.
// Their numeric values travel on the wire and in the shm layout: they are frozen. Add new values
// at the end; never renumber or reuse one.
#pragma once

#include "sparsecar/kernels/codecs.h"
#include "sparsecar/kernels/selectors.h"
