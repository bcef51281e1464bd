/* stepguard: the one header a training loop includes. */
#pragma once

#include "stepguard/distributed.h"
#include "stepguard/guarded_optimizer.h"
#include "stepguard/layout.h"
#include "stepguard/options.h"
#include "stepguard/replay.h"
#include "stepguard/tools.h"
#include "stepguard/types.h"
#include "stepguard/version.h"
