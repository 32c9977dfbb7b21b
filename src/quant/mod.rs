//! Block formats: CPU dequantization and dot products. (being written)
