/* The virtio 1.x PCI transport's registers and status bits, shared by kumo's guest drivers
 * (virtio-net in src/net/virtio.c, virtio-blk in src/blk/blk.c). */
#pragma once

/* struct virtio_pci_common_cfg */
#define CC_DFSELECT 0x00
#define CC_DF 0x04
#define CC_GFSELECT 0x08
#define CC_GF 0x0c
#define CC_MSIX_CONFIG 0x10
#define CC_STATUS 0x14
#define CC_GENERATION 0x15
#define CC_Q_SELECT 0x16
#define CC_Q_SIZE 0x18
#define CC_Q_MSIX 0x1a
#define CC_Q_ENABLE 0x1c
#define CC_Q_NOTIFY_OFF 0x1e
#define CC_Q_DESC 0x20
#define CC_Q_DRIVER 0x28
#define CC_Q_DEVICE 0x30

/* Device status. */
#define S_ACK 1
#define S_DRIVER 2
#define S_DRIVER_OK 4
#define S_FEATURES_OK 8
#define S_NEEDS_RESET 0x40
#define S_FAILED 0x80

#define F_VERSION_1 (1UL << 32)
#define NO_VECTOR 0xffff
