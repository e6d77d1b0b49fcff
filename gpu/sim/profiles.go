package sim

import (
	"slices"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Profile names a simulated node layout that New accepts.
type Profile struct {
	Name        string
	Description string
}

// model is one GPU product: what NVML reports about it and how it splits into
// MIG instances.
type model struct {
	name    string
	memMiB  uint64
	ccMajor int
	ccMinor int
	arch    nvml.DeviceArchitecture
	brand   nvml.BrandType
	// pciDeviceID is device id << 16 | vendor id, as nvmlPciInfo_t.pciDeviceId
	// and the device-filter of mig-parted configs spell it; it and
	// pciSubsystem are one pair NVIDIA's driver README lists for the name.
	pciDeviceID  uint32
	pciSubsystem uint32
	sms          uint32
	copyEngines  uint32
	maxSMMHz     uint32
	maxMemMHz    uint32
	idleSMMHz    uint32
	idlePowerMW  uint32
	powerLimitMW uint32
	idleTempC    uint32
	// nvlinks is the number of NVLink lanes (0: none), nvlinkVersion their generation.
	nvlinks       int
	nvlinkVersion uint32
	// rowRemap: Ampere and newer remap rows; Volta retires pages instead.
	rowRemap bool
	// mig is nil for GPUs without MIG.
	mig []giProfile
}

// giProfile is one GPU instance profile of a MIG-capable model.
type giProfile struct {
	enum  int    // nvml.GPU_INSTANCE_PROFILE_*
	hwID  uint32 // the id a real driver reports in nvmlGpuInstanceProfileInfo_t.id
	name  string // "1g.5gb+me"
	slice uint32 // compute slices
	// size is the number of memory slices (of 8) a placement occupies and
	// starts the placements' first slices: NVML's possible placements.
	size    uint32
	starts  []uint32
	count   uint32 // max instances per GPU
	memMiB  uint64
	sms     uint32
	ce, dec uint32
	enc     uint32
	jpeg    uint32
	ofa     uint32
}

// migShape is one GPU instance profile of a MIG geometry: profile, its
// name's suffix, compute slices, memory slices per placement, possible
// starts, max count, and the hardware id drivers report.
type migShape struct {
	enum   int
	hwID   uint32
	suffix string
	slice  uint32
	size   uint32
	starts []uint32
	count  uint32
}

// migShapes is the geometry of every 7-compute-slice, 8-memory-slice MIG
// GPU (A100, H100, H200, GH200, B200): NVIDIA MIG User Guide, "Supported MIG
// Profiles", the A100 and H100 tables and their diagrams of placements.
var migShapes = []migShape{
	{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 19, "", 1, 1, []uint32{0, 1, 2, 3, 4, 5, 6}, 7},
	{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "+me", 1, 1, []uint32{0, 1, 2, 3, 4, 5, 6}, 1},
	{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "", 1, 2, []uint32{0, 2, 4, 6}, 4},
	{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 14, "", 2, 2, []uint32{0, 2, 4}, 3},
	{nvml.GPU_INSTANCE_PROFILE_3_SLICE, 9, "", 3, 4, []uint32{0, 4}, 2},
	{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 5, "", 4, 4, []uint32{0}, 1},
	{nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0, "", 7, 8, []uint32{0}, 1},
}

// a30Shapes is the A30's geometry, 4 compute and 4 memory slices: MIG User
// Guide, "Supported MIG Profiles", "A30 MIG Profiles" (1g.6gb x4, 1g.6gb+me
// x1, 2g.12gb x2, 2g.12gb+me x1, 4g.24gb x1).
var a30Shapes = []migShape{
	{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 14, "", 1, 1, []uint32{0, 1, 2, 3}, 4},
	{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 21, "+me", 1, 1, []uint32{0, 1, 2, 3}, 1},
	{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 5, "", 2, 2, []uint32{0, 2}, 2},
	{nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1, 6, "+me", 2, 2, []uint32{0, 2}, 1},
	{nvml.GPU_INSTANCE_PROFILE_4_SLICE, 0, "", 4, 4, []uint32{0}, 1},
}

// migEngines are per-shape (in the shapes' order) memory, SMs and engines.
type migEngines struct {
	memGB                     uint64 // the name's "Ngb"
	memMiB                    uint64
	sms, ce, dec, enc, jpg, o uint32
}

func buildMIG(shapes []migShape, engines ...migEngines) []giProfile {
	if len(engines) != len(shapes) {
		panic("sim: one engine row per MIG shape") // a programming error in the tables below
	}
	out := make([]giProfile, len(shapes))
	for i, s := range shapes {
		e := engines[i]
		out[i] = giProfile{
			enum: s.enum, hwID: s.hwID,
			name:  strconv.Itoa(int(s.slice)) + "g." + strconv.Itoa(int(e.memGB)) + "gb" + s.suffix,
			slice: s.slice, size: s.size, starts: s.starts, count: s.count,
			memMiB: e.memMiB, sms: e.sms, ce: e.ce, dec: e.dec, enc: e.enc, jpeg: e.jpg, ofa: e.o,
		}
	}
	return out
}

// hopperEngines are the engines of every Hopper MIG GPU: MIG User Guide,
// "Supported MIG Profiles", the "H100 MIG Profiles" and "H200 MIG Profiles"
// tables, which agree (1g: 1 NVDEC, 1 JPEG, 1 copy engine; +me adds an
// OFA; 7g: 7 NVDECs, 7 JPEGs, 1 OFA, 8 copy engines). The guide gives SMs
// as sevenths; the counts are the driver's (nvidia-smi mig -lgip on H100
// NVL, H200 and both GH200s: the 2-memory-slice 1g profile gets 26 SMs, not
// 16). Memory is per model.
func hopperEngines(mem [7]uint64, gb [7]uint64) []migEngines {
	return []migEngines{
		{gb[0], mem[0], 16, 1, 1, 0, 1, 0},
		{gb[1], mem[1], 16, 1, 1, 0, 1, 1},
		{gb[2], mem[2], 26, 1, 1, 0, 1, 0},
		{gb[3], mem[3], 32, 2, 2, 0, 2, 0},
		{gb[4], mem[4], 60, 3, 3, 0, 3, 0},
		{gb[5], mem[5], 64, 4, 4, 0, 4, 0},
		{gb[6], mem[6], 132, 8, 7, 0, 7, 1},
	}
}

// ampereEngines are the A100 table's SMs and engines per profile (MIG User
// Guide, "A100 MIG Profiles": 1g: no media engines, +me: 1 NVDEC, 1 JPEG,
// 1 OFA; 7g: 5 NVDECs, 1 JPEG, 1 OFA), shared by the 40 and 80 GB A100.
func ampereEngines(mem [7]uint64, gb [7]uint64) []migEngines {
	return []migEngines{
		{gb[0], mem[0], 14, 1, 0, 0, 0, 0},
		{gb[1], mem[1], 14, 1, 1, 0, 1, 1},
		{gb[2], mem[2], 14, 1, 1, 0, 0, 0},
		{gb[3], mem[3], 28, 2, 1, 0, 0, 0},
		{gb[4], mem[4], 42, 3, 2, 0, 0, 0},
		{gb[5], mem[5], 56, 4, 2, 0, 0, 0},
		{gb[6], mem[6], 98, 7, 5, 0, 1, 1},
	}
}

// Every MIG model follows one table of NVIDIA's MIG User Guide, "Supported
// MIG Profiles" (named next to it): which profiles, their placements, how
// many, and their engines. The guide gives memory and SMs only as fractions,
// so the sizes in MiB and the SM counts are what the driver reports
// (nvidia-smi mig -lgip, as posted with NVIDIA's mig-parted and GPU Operator
// changes for each model, and by users) where we found them; the few we did
// not find are ours and say so. The totals are what nvidia-smi reports.
// Each size rounds to the profile's name the way NVIDIA's tools name
// profiles (TestMIGProfileNamesRound checks every model).
var (
	a100 = &model{
		name: "NVIDIA A100-SXM4-40GB", memMiB: 40960, ccMajor: 8, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_AMPERE, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x20B010DE, pciSubsystem: 0x134F10DE, sms: 108, copyEngines: 7,
		maxSMMHz: 1410, maxMemMHz: 1215, idleSMMHz: 210, idlePowerMW: 55_000, powerLimitMW: 400_000,
		idleTempC: 31, nvlinks: 12, nvlinkVersion: 3, rowRemap: true,
		mig: buildMIG(migShapes, ampereEngines([7]uint64{4864, 4864, 9856, 9856, 19968, 19968, 40192}, [7]uint64{5, 5, 10, 10, 20, 20, 40})...),
	}
	h100 = &model{
		name: "NVIDIA H100 80GB HBM3", memMiB: 81559, ccMajor: 9, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_HOPPER, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x233010DE, pciSubsystem: 0x16C110DE, sms: 132, copyEngines: 8,
		maxSMMHz: 1980, maxMemMHz: 2619, idleSMMHz: 345, idlePowerMW: 70_000, powerLimitMW: 700_000,
		idleTempC: 29, nvlinks: 18, nvlinkVersion: 4, rowRemap: true,
		mig: buildMIG(migShapes, hopperEngines([7]uint64{9984, 9984, 20096, 20096, 40448, 40448, 81152}, [7]uint64{10, 10, 20, 20, 40, 40, 80})...),
	}
	// "A100 MIG Profiles": the A100-SXM4-80GB has the 40 GB table's
	// profiles with twice the memory (1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb,
	// 3g.40gb, 4g.40gb, 7g.80gb).
	a100_80 = &model{
		name: "NVIDIA A100-SXM4-80GB", memMiB: 81920, ccMajor: 8, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_AMPERE, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x20B210DE, pciSubsystem: 0x147F10DE, sms: 108, copyEngines: 7,
		maxSMMHz: 1410, maxMemMHz: 1593, idleSMMHz: 210, idlePowerMW: 60_000, powerLimitMW: 400_000,
		idleTempC: 31, nvlinks: 12, nvlinkVersion: 3, rowRemap: true,
		mig: buildMIG(migShapes, ampereEngines([7]uint64{9728, 9728, 19968, 19968, 40192, 40192, 80896}, [7]uint64{10, 10, 20, 20, 40, 40, 80})...),
	}
	// "A30 MIG Profiles" (the table cited at a30Shapes): 1g.6gb has no
	// media engines, +me 1 NVDEC, 1 JPEG, 1 OFA; 2g.12gb 2 NVDECs, +me adds
	// a JPEG and an OFA; 4g.24gb 4 NVDECs, 1 JPEG, 1 OFA; one copy engine
	// per compute slice. Sizes: 5.81, 11.69 and 23.44 GiB as the driver
	// reports them.
	a30 = &model{
		name: "NVIDIA A30", memMiB: 24576, ccMajor: 8, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_AMPERE, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x20B710DE, pciSubsystem: 0x153210DE, sms: 56, copyEngines: 4,
		maxSMMHz: 1440, maxMemMHz: 1215, idleSMMHz: 210, idlePowerMW: 30_000, powerLimitMW: 165_000,
		idleTempC: 30, rowRemap: true,
		mig: buildMIG(a30Shapes,
			migEngines{6, 5952, 14, 1, 0, 0, 0, 0},
			migEngines{6, 5952, 14, 1, 1, 0, 1, 1},
			migEngines{12, 11968, 28, 2, 2, 0, 0, 0},
			migEngines{12, 11968, 28, 2, 2, 0, 1, 1},
			migEngines{24, 24000, 56, 4, 4, 0, 1, 1},
		),
	}
	// "H100 MIG Profiles", the H100 94GB (PCIe and SXM5) table: the H100
	// NVL's profiles are named for its 94 GB (1g.12gb ... 7g.94gb). Sizes:
	// 10.75, 21.62, 46.38 and 93.12 GiB from the driver.
	h100nvl = &model{
		name: "NVIDIA H100 NVL", memMiB: 95830, ccMajor: 9, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_HOPPER, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x232110DE, pciSubsystem: 0x183910DE, sms: 132, copyEngines: 8,
		maxSMMHz: 1785, maxMemMHz: 2619, idleSMMHz: 345, idlePowerMW: 60_000, powerLimitMW: 400_000,
		idleTempC: 30, nvlinks: 12, nvlinkVersion: 4, rowRemap: true,
		mig: buildMIG(migShapes, hopperEngines([7]uint64{11008, 11008, 22144, 22144, 47488, 47488, 95360}, [7]uint64{12, 12, 24, 24, 47, 47, 94})...),
	}
	// "H200 MIG Profiles": 1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb,
	// 4g.71gb, 7g.141gb. Sizes: 16.00, 32.25, 69.50 and 139.75 GiB from the
	// driver.
	h200 = &model{
		name: "NVIDIA H200", memMiB: 143771, ccMajor: 9, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_HOPPER, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x233510DE, pciSubsystem: 0x18BE10DE, sms: 132, copyEngines: 8,
		maxSMMHz: 1980, maxMemMHz: 3201, idleSMMHz: 345, idlePowerMW: 75_000, powerLimitMW: 700_000,
		idleTempC: 29, nvlinks: 18, nvlinkVersion: 4, rowRemap: true,
		mig: buildMIG(migShapes, hopperEngines([7]uint64{16384, 16384, 33024, 33024, 71168, 71168, 143104}, [7]uint64{18, 18, 35, 35, 71, 71, 141})...),
	}
	// "H100 MIG Profiles", the H100 96GB table ("Supported GPUs": H100 on
	// GH200, 96GB): 1g.12gb ... 3g.48gb, 4g.48gb, 7g.96gb. Sizes: 11.00,
	// 23.00, 46.50 and 93.00 GiB from the driver.
	gh200 = &model{
		name: "NVIDIA GH200 480GB", memMiB: 97871, ccMajor: 9, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_HOPPER, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x234210DE, pciSubsystem: 0x180910DE, sms: 132, copyEngines: 8,
		maxSMMHz: 1980, maxMemMHz: 2619, idleSMMHz: 345, idlePowerMW: 90_000, powerLimitMW: 900_000,
		idleTempC: 30, nvlinks: 18, nvlinkVersion: 4, rowRemap: true,
		mig: buildMIG(migShapes, hopperEngines([7]uint64{11264, 11264, 23552, 23552, 47616, 47616, 95232}, [7]uint64{12, 12, 24, 24, 48, 48, 96})...),
	}
	// The GH200 with 144 GB of HBM3e has the Hopper profiles the guide's
	// H100 and H200 tables share, named for its memory as its driver names
	// them (1g.18gb, 1g.18gb+me, 1g.36gb, 2g.36gb, 3g.72gb, 4g.72gb,
	// 7g.144gb; the guide has no table of its own). Sizes 17.50 and 35.25
	// GiB are the driver's; 3g/4g (71 GiB) and 7g (142 GiB) are ours. The
	// total is ours too: CUDA reports 145920 MiB, and NVML reports 591 MiB
	// more than OpenCL's total (CUDA's) on the 96 GB GH200; the driver's name
	// 7g.144gb needs a total above 143 GiB, which that gives.
	gh200_144 = &model{
		name: "NVIDIA GH200 144G HBM3e", memMiB: 146511, ccMajor: 9, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_HOPPER, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x234810DE, pciSubsystem: 0x18D210DE, sms: 132, copyEngines: 8,
		maxSMMHz: 1980, maxMemMHz: 2619, idleSMMHz: 345, idlePowerMW: 90_000, powerLimitMW: 900_000,
		idleTempC: 30, nvlinks: 18, nvlinkVersion: 4, rowRemap: true,
		mig: buildMIG(migShapes, hopperEngines([7]uint64{17920, 17920, 36096, 36096, 72704, 72704, 145408}, [7]uint64{18, 18, 36, 36, 72, 72, 144})...),
	}
	// "B200 MIG Profiles": 1g.23gb, 1g.23gb+me, 1g.45gb, 2g.45gb, 3g.90gb,
	// 4g.90gb, 7g.180gb; 1 NVDEC and 1 JPEG in every profile, an OFA in +me
	// and 7g, and 2, 2, 2, 3, 6, 8, 16 copy engines. (The driver's -lgip
	// shows 2 NVDECs and 4 copy engines on 2g.45gb; we follow the guide.)
	// Sizes 20.50, 44.25, 89.00 and 178.50 GiB and SMs 18, 18, 30, 36, 70,
	// 72 and all 148 are the driver's.
	b200 = &model{
		name: "NVIDIA B200", memMiB: 183359, ccMajor: 10, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_BLACKWELL, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x290110DE, pciSubsystem: 0x199910DE, sms: 148, copyEngines: 16,
		maxSMMHz: 1965, maxMemMHz: 3996, idleSMMHz: 345, idlePowerMW: 140_000, powerLimitMW: 1_000_000,
		idleTempC: 30, nvlinks: 18, nvlinkVersion: 5, rowRemap: true,
		mig: buildMIG(migShapes,
			migEngines{23, 20992, 18, 2, 1, 0, 1, 0},
			migEngines{23, 20992, 18, 2, 1, 0, 1, 1},
			migEngines{45, 45312, 30, 2, 1, 0, 1, 0},
			migEngines{45, 45312, 36, 3, 1, 0, 1, 0},
			migEngines{90, 91136, 70, 6, 1, 0, 1, 0},
			migEngines{90, 91136, 72, 8, 1, 0, 1, 0},
			migEngines{180, 182784, 148, 16, 1, 0, 1, 1},
		),
	}
	// "GB200 MIG Profiles" (the MIG User Guide's table for the Blackwell GPU
	// of a GB200 superchip, with the B200's geometry): 1g.23gb, 1g.23gb+me,
	// 1g.47gb, 2g.47gb, 3g.93gb, 4g.93gb, 7g.186gb. The 1g and 2g rows are
	// the driver's (nvidia-smi mig -lgip on a GB200 NVL72 tray, posted in
	// NVIDIA/mig-parted#227): 22.00 GiB with 18 SMs and 2 copy engines for
	// 1g.23gb, 45.50 GiB for 1g.47gb (32 SMs, 2 copy engines) and 2g.47gb
	// (38 SMs, 4 copy engines, 2 NVDECs, 2 JPEGs). The 3g, 4g and 7g sizes
	// (91.50 and 183.50 GiB, following the B200's steps) and SMs (the
	// B200's) are ours. The total (189471 MiB), PCI ids (0x2941, subsystem
	// 0x2046) and 1200 W limit are what NVML reports on GB200 trays.
	gb200 = &model{
		name: "NVIDIA GB200", memMiB: 189471, ccMajor: 10, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_BLACKWELL, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x294110DE, pciSubsystem: 0x204610DE, sms: 148, copyEngines: 16,
		maxSMMHz: 2062, maxMemMHz: 3996, idleSMMHz: 345, idlePowerMW: 160_000, powerLimitMW: 1_200_000,
		idleTempC: 30, nvlinks: 18, nvlinkVersion: 5, rowRemap: true,
		mig: buildMIG(migShapes,
			migEngines{23, 22528, 18, 2, 1, 0, 1, 0},
			migEngines{23, 22528, 18, 2, 1, 0, 1, 1},
			migEngines{47, 46592, 32, 2, 1, 0, 1, 0},
			migEngines{47, 46592, 38, 4, 2, 0, 2, 0},
			migEngines{93, 93696, 70, 6, 3, 0, 3, 0},
			migEngines{93, 93696, 72, 8, 4, 0, 4, 0},
			migEngines{186, 187904, 148, 16, 7, 0, 7, 1},
		),
	}
	v100 = &model{
		name: "Tesla V100-SXM2-32GB", memMiB: 32768, ccMajor: 7, ccMinor: 0,
		arch: nvml.DEVICE_ARCH_VOLTA, brand: nvml.BRAND_TESLA,
		pciDeviceID: 0x1DB510DE, pciSubsystem: 0x124910DE, sms: 80, copyEngines: 8,
		maxSMMHz: 1530, maxMemMHz: 877, idleSMMHz: 135, idlePowerMW: 42_000, powerLimitMW: 300_000,
		idleTempC: 34, nvlinks: 6, nvlinkVersion: 2,
	}
	l40s = &model{
		name: "NVIDIA L40S", memMiB: 46068, ccMajor: 8, ccMinor: 9,
		arch: nvml.DEVICE_ARCH_ADA, brand: nvml.BRAND_NVIDIA,
		pciDeviceID: 0x26B910DE, pciSubsystem: 0x185110DE, sms: 142, copyEngines: 2,
		maxSMMHz: 2520, maxMemMHz: 9001, idleSMMHz: 210, idlePowerMW: 35_000, powerLimitMW: 350_000,
		idleTempC: 27, rowRemap: true,
	}
)

// linkEnd is the far end of one NVLink lane: a GPU (by index) or an NVSwitch.
type linkEnd struct {
	gpu int // -1 when the lane ends at a switch
	sw  int // switch index when gpu == -1
}

// nodeSpec is a whole simulated node.
type nodeSpec struct {
	name, desc string
	model      *model
	// bus holds each GPU's PCI bus number, ascending: NVML indexes GPUs in
	// PCI bus order.
	bus []uint32
	// domain holds each GPU's PCI domain where they are not all in domain
	// 0 (nil): ascending with bus, in NVML's order.
	domain     []uint32
	numa       func(i int) int
	level      func(i, j int) nvml.GpuTopologyLevel
	links      func(n int) [][]linkEnd
	switchBus  []uint32
	switchPCIx uint32 // NVSwitch pciDeviceId
	// fabric: the GPUs are attached to a multi-node NVLink fabric (NVL72
	// racks): they answer NVML's fabric info, and the node takes a clique
	// (WithClique).
	fabric bool
	// migLayout, when set, starts every GPU with MIG on and these GPU
	// instance profiles (GPU_INSTANCE_PROFILE_* indices) created, each with
	// one full compute instance, through the node's own NVML calls.
	migLayout []int
}

// withMIGVariant adds a copy of the spec named base as name, with MIG on
// and layout created on every GPU: a node with MIG devices from the start,
// for `gpu-agent run` and benchmarks that need them.
func withMIGVariant(specs []*nodeSpec, base, name, desc string, layout []int) []*nodeSpec {
	for _, s := range specs {
		if s.name == base {
			v := *s
			v.name, v.desc, v.migLayout = name, desc, layout
			return append(specs, &v)
		}
	}
	panic("sim: no profile " + base) // a programming error in the table below
}

// withModelVariant adds a copy of the spec named base as name, with another
// GPU model in the same chassis.
func withModelVariant(specs []*nodeSpec, base, name, desc string, m *model) []*nodeSpec {
	for _, s := range specs {
		if s.name == base {
			v := *s
			v.name, v.desc, v.model = name, desc, m
			return append(specs, &v)
		}
	}
	panic("sim: no profile " + base) // a programming error in the table
}

func pairs(i, j int) bool { return i/2 == j/2 }

// dgxPCIe: GPU pairs share a PCIe switch tree, everything else crosses the SMP link.
func dgxPCIe(i, j int) nvml.GpuTopologyLevel {
	if pairs(i, j) {
		return nvml.TOPOLOGY_MULTIPLE
	}
	return nvml.TOPOLOGY_SYSTEM
}

// cubeMesh is the DGX-1 hybrid cube-mesh: {a, b, lanes}.
var cubeMesh = [...][3]int{
	{0, 1, 1}, {0, 2, 1}, {0, 3, 2}, {0, 4, 2}, {1, 2, 2}, {1, 3, 1}, {1, 5, 2}, {2, 3, 2},
	{2, 6, 1}, {3, 7, 1}, {4, 5, 1}, {4, 6, 1}, {4, 7, 2}, {5, 6, 2}, {5, 7, 1}, {6, 7, 2},
}

// cubeMeshLinks wires islands of 8 GPUs; each lane takes the next free link
// index on both of its ends, so link numbers follow the table's order.
func cubeMeshLinks(n int) [][]linkEnd {
	out := make([][]linkEnd, n)
	for base := 0; base+8 <= n; base += 8 {
		for _, e := range cubeMesh {
			a, b := base+e[0], base+e[1]
			for range e[2] {
				out[a] = append(out[a], linkEnd{gpu: b})
				out[b] = append(out[b], linkEnd{gpu: a})
			}
		}
	}
	return out
}

// switchLinks gives every GPU the same lanes-per-switch split.
func switchLinks(perSwitch []int) func(n int) [][]linkEnd {
	return func(n int) [][]linkEnd {
		out := make([][]linkEnd, n)
		for i := range out {
			for sw, lanes := range perSwitch {
				for range lanes {
					out[i] = append(out[i], linkEnd{gpu: -1, sw: sw})
				}
			}
		}
		return out
	}
}

func noLinks(n int) [][]linkEnd { return make([][]linkEnd, n) }

var nodeSpecs = withMIGVariant([]*nodeSpec{
	{
		name: "dgx-a100", desc: "8x A100-SXM4-40GB, 6 NVSwitches (12 lanes per GPU), 4 NUMA nodes, MIG capable",
		model: a100,
		bus:   []uint32{0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD},
		numa: func(i int) int {
			return [...]int{3, 3, 1, 1, 7, 7, 5, 5}[i]
		},
		level:      dgxPCIe,
		links:      switchLinks([]int{2, 2, 2, 2, 2, 2}),
		switchBus:  []uint32{0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9},
		switchPCIx: 0x1AF110DE,
	},
	{
		name: "dgx-h100", desc: "8x H100 80GB HBM3, 4 NVSwitches (18 lanes per GPU), 2 NUMA nodes, MIG capable",
		model:      h100,
		bus:        []uint32{0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB},
		numa:       func(i int) int { return i / 4 },
		level:      dgxPCIe,
		links:      switchLinks([]int{5, 4, 4, 5}),
		switchBus:  []uint32{0xE4, 0xE5, 0xE6, 0xE7},
		switchPCIx: 0x22A310DE,
	},
	{
		name: "dgx-b200", desc: "8x B200 (180 GB), 2 NVSwitch chips (18 lanes per GPU), 2 NUMA nodes, MIG capable",
		model:      b200,
		bus:        []uint32{0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF},
		numa:       func(i int) int { return i / 4 },
		level:      dgxPCIe,
		links:      switchLinks([]int{9, 9}),
		switchBus:  []uint32{0xE4, 0xE5},
		switchPCIx: 0x2B0010DE,
	},
	{
		name: "pcie-h100nvl-x2", desc: "2x H100 NVL (94 GB) on one PCIe switch, no NVLink bridge, 1 NUMA node, MIG capable",
		model: h100nvl,
		bus:   []uint32{0x41, 0x42},
		numa:  func(int) int { return 0 },
		level: func(int, int) nvml.GpuTopologyLevel { return nvml.TOPOLOGY_SINGLE },
		links: noLinks,
	},
	{
		name: "gh200", desc: "1x GH200 (Grace Hopper, 96 GB HBM3), 1 NUMA node, MIG capable",
		model: gh200,
		bus:   []uint32{0x01},
		numa:  func(int) int { return 0 },
		level: func(int, int) nvml.GpuTopologyLevel { return nvml.TOPOLOGY_INTERNAL },
		links: noLinks,
	},
	{
		// One compute tray of a GB200 NVL72 rack: two superchips, each a
		// Grace CPU with two Blackwell GPUs on NVLink-C2C. Each GPU sits in
		// a PCI domain of its own (0008, 0009 on the first Grace, 0018,
		// 0019 on the second: lspci of a tray, NVIDIA/mig-parted#227). Its
		// 18 NVLink 5 lanes all leave the tray, one to each of the 18
		// NVSwitch chips of the rack's 9 switch trays, so GPUs of a tray
		// reach each other, and the other 17 trays' GPUs, only through
		// those switches. The switches are not PCI devices of this host;
		// the bus numbers the sim gives them are ours, only to tell them
		// apart. PCIe levels: GPUs on one Grace share its NUMA node, the
		// others cross the chip-to-chip link (ours, as nvidia-smi topo -m
		// reports NODE and SYS on Grace systems).
		name: "gb200-tray", desc: "4x GB200 (Blackwell, 186 GB) of one NVL72 compute tray, 2 Grace CPUs (2 NUMA nodes), 18 NVLink lanes per GPU to the rack's NVSwitches, fabric-attached (clique=N), MIG capable",
		model:  gb200,
		domain: []uint32{0x0008, 0x0009, 0x0018, 0x0019},
		bus:    []uint32{0x01, 0x01, 0x01, 0x01},
		numa:   func(i int) int { return i / 2 },
		level: func(i, j int) nvml.GpuTopologyLevel {
			if i/2 == j/2 {
				return nvml.TOPOLOGY_NODE
			}
			return nvml.TOPOLOGY_SYSTEM
		},
		links:      switchLinks([]int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1}),
		switchBus:  []uint32{0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8B, 0x8C, 0x8D, 0x8E, 0x8F, 0x90, 0x91},
		switchPCIx: 0x2B0010DE,
		fabric:     true,
	},
	{
		name: "dgx1-v100", desc: "8x Tesla V100-SXM2-32GB, NVLink hybrid cube-mesh, 2 NUMA nodes, no MIG",
		model: v100,
		bus:   []uint32{0x06, 0x07, 0x0A, 0x0B, 0x85, 0x86, 0x89, 0x8A},
		numa:  func(i int) int { return i / 4 },
		level: func(i, j int) nvml.GpuTopologyLevel {
			switch {
			case pairs(i, j):
				return nvml.TOPOLOGY_SINGLE
			case i/4 == j/4:
				return nvml.TOPOLOGY_HOSTBRIDGE
			}
			return nvml.TOPOLOGY_SYSTEM
		},
		links: cubeMeshLinks,
	},
	{
		name: "pcie-8gpu", desc: "8x L40S on 4 PCIe switches, no NVLink, 2 NUMA nodes",
		model: l40s,
		bus:   []uint32{0x1B, 0x1C, 0x3D, 0x3E, 0x9B, 0x9C, 0xBD, 0xBE},
		numa:  func(i int) int { return i / 4 },
		level: func(i, j int) nvml.GpuTopologyLevel {
			switch {
			case pairs(i, j):
				return nvml.TOPOLOGY_SINGLE
			case i/4 == j/4:
				return nvml.TOPOLOGY_NODE
			}
			return nvml.TOPOLOGY_SYSTEM
		},
		links: noLinks,
	},
	{
		name: "pcie-4gpu", desc: "4x L40S on 2 PCIe switches, no NVLink, 2 NUMA nodes",
		model: l40s,
		bus:   []uint32{0x41, 0x42, 0xC1, 0xC2},
		numa:  func(i int) int { return i / 2 },
		level: func(i, j int) nvml.GpuTopologyLevel {
			if pairs(i, j) {
				return nvml.TOPOLOGY_SINGLE
			}
			return nvml.TOPOLOGY_SYSTEM
		},
		links: noLinks,
	},
	{
		name: "two-islands-16", desc: "16x Tesla V100-SXM2-32GB as two 8-GPU NVLink cube-mesh islands, 2 NUMA nodes, no MIG",
		model: v100,
		bus: []uint32{
			0x06, 0x07, 0x0A, 0x0B, 0x1A, 0x1B, 0x1E, 0x1F,
			0x86, 0x87, 0x8A, 0x8B, 0x9A, 0x9B, 0x9E, 0x9F,
		},
		numa: func(i int) int { return i / 8 },
		level: func(i, j int) nvml.GpuTopologyLevel {
			switch {
			case pairs(i, j):
				return nvml.TOPOLOGY_SINGLE
			case i/4 == j/4:
				return nvml.TOPOLOGY_MULTIPLE
			case i/8 == j/8:
				return nvml.TOPOLOGY_NODE
			}
			return nvml.TOPOLOGY_SYSTEM
		},
		links: cubeMeshLinks,
	},
}, "dgx-h100", "dgx-h100-mig", "dgx-h100 with MIG on and 7x 1g.10gb instances per GPU", slices.Repeat([]int{nvml.GPU_INSTANCE_PROFILE_1_SLICE}, 7))

// Nodes that are another node's chassis with another GPU model.
func init() {
	nodeSpecs = withModelVariant(nodeSpecs, "dgx-a100", "dgx-a100-80gb", "8x A100-SXM4-80GB, 6 NVSwitches (12 lanes per GPU), 4 NUMA nodes, MIG capable", a100_80)
	nodeSpecs = withModelVariant(nodeSpecs, "dgx-h100", "dgx-h200", "8x H200 (141 GB), 4 NVSwitches (18 lanes per GPU), 2 NUMA nodes, MIG capable", h200)
	nodeSpecs = withModelVariant(nodeSpecs, "gh200", "gh200-144g", "1x GH200 (Grace Hopper, 144 GB HBM3e), 1 NUMA node, MIG capable", gh200_144)
	nodeSpecs = withModelVariant(nodeSpecs, "pcie-4gpu", "pcie-a30x4", "4x A30 (24 GB) on 2 PCIe switches, no NVLink, 2 NUMA nodes, MIG capable (4 slices)", a30)
}

// Profiles lists the simulated nodes New accepts, sorted by name.
func Profiles() []Profile {
	out := make([]Profile, 0, len(nodeSpecs))
	for _, s := range nodeSpecs {
		out = append(out, Profile{Name: s.name, Description: s.desc})
	}
	slices.SortFunc(out, func(a, b Profile) int { return strings.Compare(a.Name, b.Name) })
	return out
}
