# Finds the LibTorch stepguard builds against, in one of two ways, and sets what the build reads:
# TORCH_LIBRARIES, TORCH_INSTALL_PREFIX, Torch_DIR, Torch_VERSION, STEPGUARD_TORCH_IMPORT, and in
# both ways the target stepguard::torch_cpu (torch's CPU libraries: what the library links).
#
#   stepguard_find_torch(CUDA)  torch's own TorchConfig.cmake, as a LibTorch user calls it: for a
#                               build with the CUDA kernel (the toolkit is there).
#   stepguard_find_torch(CPU)   torch's CPU libraries only (libtorch_cpu, libc10), the
#                               way torch.utils.cpp_extension links a CPU extension.
#
# Why two: the registry's torch wheel is a CUDA build, and its TorchConfig.cmake (through
# Caffe2Config.cmake) stops the configure step when no CUDA toolkit is installed ("Your installed
# Caffe2 version uses CUDA but I cannot find the CUDA libraries"). A CPU-only stepguard uses none
# of torch's CUDA parts, so it imports the CPU libraries itself and never runs that check. This
# file is installed beside stepguard-config.cmake, which calls it the way the build did.
#
# torch is found from Torch_DIR (its share/cmake/Torch) or from CMAKE_PREFIX_PATH (the folder
# torch.utils.cmake_prefix_path names), as find_package(Torch) finds it, and last from
# STEPGUARD_TORCH_DIR_HINT: the installed package records there the torch it was built against.

# The folder of TorchConfig.cmake, from Torch_DIR or CMAKE_PREFIX_PATH; an error naming both.
function(_stepguard_torch_config_dir out)
  set(candidates)
  if(Torch_DIR)
    list(APPEND candidates ${Torch_DIR})
  endif()
  foreach(prefix IN LISTS CMAKE_PREFIX_PATH)
    list(APPEND candidates ${prefix}/Torch ${prefix}/share/cmake/Torch)
  endforeach()
  if(STEPGUARD_TORCH_DIR_HINT)
    list(APPEND candidates ${STEPGUARD_TORCH_DIR_HINT})
  endif()
  foreach(dir IN LISTS candidates)
    if(EXISTS ${dir}/TorchConfig.cmake)
      get_filename_component(dir ${dir} ABSOLUTE)
      set(${out} ${dir} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  message(FATAL_ERROR "stepguard: LibTorch not found: no TorchConfig.cmake in Torch_DIR "
    "('${Torch_DIR}') nor under CMAKE_PREFIX_PATH ('${CMAKE_PREFIX_PATH}'). Point either at the "
    "torch to build against: -DCMAKE_PREFIX_PATH=$(python -c 'import torch; "
    "print(torch.utils.cmake_prefix_path)')")
endfunction()

# torch's CPU libraries as one imported target, stepguard::torch_cpu: what TorchConfig's torch
# target gives a CPU consumer (headers, the distributed defines the c10d headers test, the C++
# standard torch's headers need), without Caffe2's CUDA dependencies. Made in both modes: the
# stepguard library, stepguard._C and the CLI link it and nothing of torch's CUDA side, so that they
# load beside a CPU-only torch; a CUDA build's kernel path needs no torch CUDA library (it reaches
# the current stream through c10's virtual device guard, and NCCL is opened when present).
# libtorch.so itself is left out: it exports nothing stepguard calls, and a CUDA wheel's copy needs
# libtorch_cuda.so.
macro(_stepguard_torch_cpu_target)
  get_filename_component(TORCH_INSTALL_PREFIX "${Torch_DIR}/../../.." ABSOLUTE)
  foreach(lib torch_cpu c10)
    find_library(STEPGUARD_TORCH_${lib}_LIBRARY ${lib} PATHS ${TORCH_INSTALL_PREFIX}/lib
                 NO_DEFAULT_PATH)
    if(NOT STEPGUARD_TORCH_${lib}_LIBRARY)
      message(FATAL_ERROR "stepguard: lib${lib}.so missing in ${TORCH_INSTALL_PREFIX}/lib")
    endif()
  endforeach()
  if(NOT TARGET stepguard::torch_cpu)
    add_library(stepguard::torch_cpu INTERFACE IMPORTED)
    # libtorch_cpu as Caffe2's torch_cpu_library links it: kept even where nothing names a symbol
    # of it (its static initializers register the CPU kernels).
    set_target_properties(stepguard::torch_cpu PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES
        "${TORCH_INSTALL_PREFIX}/include;${TORCH_INSTALL_PREFIX}/include/torch/csrc/api/include"
      INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED;USE_C10D_GLOO;USE_RPC;USE_TENSORPIPE"
      INTERFACE_LINK_LIBRARIES
        "-Wl,--no-as-needed,${STEPGUARD_TORCH_torch_cpu_LIBRARY},--as-needed;${STEPGUARD_TORCH_c10_LIBRARY}")
    # The C++ standard torch's headers are written for (C++20 for current torch), read off its
    # own TorchConfig.cmake so that both imports agree.
    file(STRINGS "${Torch_DIR}/TorchConfig.cmake" _stepguard_torch_std REGEX "cxx_std_[0-9]+")
    if(_stepguard_torch_std MATCHES "cxx_std_([0-9]+)")
      set_property(TARGET stepguard::torch_cpu PROPERTY
                   INTERFACE_COMPILE_FEATURES cxx_std_${CMAKE_MATCH_1})
    endif()
  endif()
endmacro()

macro(_stepguard_import_torch_cpu)
  _stepguard_torch_config_dir(Torch_DIR)
  file(STRINGS "${Torch_DIR}/TorchConfigVersion.cmake" _stepguard_torch_version_line
       REGEX "set\\(PACKAGE_VERSION \"[0-9.]+")
  string(REGEX MATCH "[0-9]+\\.[0-9]+\\.[0-9]+" Torch_VERSION "${_stepguard_torch_version_line}")
  _stepguard_torch_cpu_target()
  set(TORCH_LIBRARIES stepguard::torch_cpu)
  set(TORCH_CXX_FLAGS "")
endmacro()

macro(stepguard_find_torch mode)
  if("${mode}" STREQUAL "CUDA")
    if(STEPGUARD_TORCH_DIR_HINT)
      find_package(Torch REQUIRED HINTS ${STEPGUARD_TORCH_DIR_HINT})
    else()
      find_package(Torch REQUIRED)
    endif()
    _stepguard_torch_cpu_target()
  elseif("${mode}" STREQUAL "CPU")
    _stepguard_import_torch_cpu()
  else()
    message(FATAL_ERROR "stepguard_find_torch: mode is CUDA or CPU, not '${mode}'")
  endif()
  set(STEPGUARD_TORCH_IMPORT ${mode})
endmacro()
