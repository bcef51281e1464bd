#include "plugin/src/libtorch_optimizer_state.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

namespace stepguard {
namespace libtorch_port {

// The optimizer param-state types stored field by field: their name, their optimizer, fields.
bool read_fields(const torch::optim::OptimizerParamState& s, std::string* type, std::int64_t* step,
                 StateFields* fields) {
  using namespace torch::optim;
  if (auto* a = dynamic_cast<const AdamWParamState*>(&s)) {
    *type = "adamw";
    *step = a->step();
    *fields = {{"exp_avg", a->exp_avg()},
               {"exp_avg_sq", a->exp_avg_sq()},
               {"max_exp_avg_sq", a->max_exp_avg_sq()}};
    return true;
  }
  if (auto* a = dynamic_cast<const AdamParamState*>(&s)) {
    *type = "adam";
    *step = a->step();
    *fields = {{"exp_avg", a->exp_avg()},
               {"exp_avg_sq", a->exp_avg_sq()},
               {"max_exp_avg_sq", a->max_exp_avg_sq()}};
    return true;
  }
  if (auto* g = dynamic_cast<const SGDParamState*>(&s)) {
    *type = "sgd";
    *step = 0;
    *fields = {{"momentum_buffer", g->momentum_buffer()}};
    return true;
  }
  if (auto* g = dynamic_cast<const AdagradParamState*>(&s)) {
    *type = "adagrad";
    *step = g->step();
    *fields = {{"sum", g->sum()}};
    return true;
  }
  if (auto* r = dynamic_cast<const RMSpropParamState*>(&s)) {
    *type = "rmsprop";
    *step = r->step();
    *fields = {{"square_avg", r->square_avg()},
               {"momentum_buffer", r->momentum_buffer()},
               {"grad_avg", r->grad_avg()}};
    return true;
  }
  return false;
}

// Whether `optimizer` keeps states of `type`.
bool optimizer_is(const torch::optim::Optimizer& o, const std::string& type) {
  using namespace torch::optim;
  if (type == "adamw") return dynamic_cast<const AdamW*>(&o) != nullptr;
  if (type == "adam") return dynamic_cast<const Adam*>(&o) != nullptr;
  if (type == "sgd") return dynamic_cast<const SGD*>(&o) != nullptr;
  if (type == "adagrad") return dynamic_cast<const Adagrad*>(&o) != nullptr;
  if (type == "rmsprop") return dynamic_cast<const RMSprop*>(&o) != nullptr;
  return false;
}

std::unique_ptr<torch::optim::OptimizerParamState> make_state(
    const std::string& type, std::int64_t step, std::map<std::string, at::Tensor>& f) {
  using namespace torch::optim;
  if (type == "adamw" || type == "adam") {
    auto fill = [&](auto& s) {
      s->step(step).exp_avg(f["exp_avg"]).exp_avg_sq(f["exp_avg_sq"]);
      s->max_exp_avg_sq(f["max_exp_avg_sq"]);
    };
    if (type == "adamw") {
      auto s = std::make_unique<AdamWParamState>();
      fill(s);
      return s;
    }
    auto s = std::make_unique<AdamParamState>();
    fill(s);
    return s;
  }
  if (type == "sgd") {
    auto s = std::make_unique<SGDParamState>();
    s->momentum_buffer(f["momentum_buffer"]);
    return s;
  }
  if (type == "adagrad") {
    auto s = std::make_unique<AdagradParamState>();
    s->step(step).sum(f["sum"]);
    return s;
  }
  auto s = std::make_unique<RMSpropParamState>();
  s->step(step).square_avg(f["square_avg"]).momentum_buffer(f["momentum_buffer"]);
  s->grad_avg(f["grad_avg"]);
  return s;
}

}  // namespace libtorch_port
}  // namespace stepguard
