// Forced into ggml-vulkan's C++ sources by scripts/build-vulkan (-include)
// where the Vulkan headers predate VK_EXT_layer_settings (Vulkan-Headers
// 1.3.261): Debian 12's libvulkan-dev is 1.3.239. ggml-vulkan always chains a
// vk::LayerSettingsCreateInfoEXT into its instance's create info (it asks
// for the validation layer's best-practice checks only when built with
// GGML_VULKAN_VALIDATE); these are the declarations it uses, laid out as the
// extension's C structures (VkLayerSettingEXT, VkLayerSettingsCreateInfoEXT)
// so the loader and drivers read the chain as newer headers would write it.
// With headers that have the extension this file declares nothing.
#pragma once
#ifdef __cplusplus
#if __has_include(<vulkan/vulkan_core.h>)
#include <vulkan/vulkan_core.h>
#ifndef VK_EXT_layer_settings
#include <cstdint>
#include <vector>
namespace vk {
enum class LayerSettingTypeEXT : int32_t {
    eBool32 = 0,
    eInt32 = 1,
    eInt64 = 2,
    eUint32 = 3,
    eUint64 = 4,
    eFloat32 = 5,
    eFloat64 = 6,
    eString = 7,
};
struct LayerSettingEXT {
    const char *pLayerName;
    const char *pSettingName;
    LayerSettingTypeEXT type;
    uint32_t valueCount;
    const void *pValues;
};
struct LayerSettingsCreateInfoEXT {
    // VK_STRUCTURE_TYPE_LAYER_SETTINGS_CREATE_INFO_EXT
    int32_t sType = 1000496000;
    const void *pNext = nullptr;
    uint32_t settingCount = 0;
    const LayerSettingEXT *pSettings = nullptr;
    explicit LayerSettingsCreateInfoEXT(const std::vector<LayerSettingEXT> &settings)
        : settingCount(static_cast<uint32_t>(settings.size())), pSettings(settings.data()) {}
};
static_assert(sizeof(LayerSettingsCreateInfoEXT) == 32, "the layout of VkLayerSettingsCreateInfoEXT");
static_assert(sizeof(LayerSettingEXT) == 32, "the layout of VkLayerSettingEXT");
}  // namespace vk
#endif
#endif
#endif
