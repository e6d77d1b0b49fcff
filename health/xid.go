package health

import (
	"fmt"
	"slices"
	"time"

	"github.com/gpu-agent/gpu-agent/config"
)

// Class is what it takes to make a GPU usable again after a fault, after the
// resolution buckets of NVIDIA's XID catalog (Ampere and newer). It decides
// how a device recovers, not whether it is marked: that is the Policy's call.
type Class int

// Classes, least severe first.
const (
	// ClassApp: the application failed, the GPU did not (catalog bucket
	// RESTART_APP). A device marked for it recovers after the quiet period.
	ClassApp Class = iota + 1
	// ClassReset: the GPU needs a reset (RESET_GPU). The device recovers when
	// the watcher sees evidence of one.
	ClassReset
	// ClassReboot: the node needs a reboot (RESTART_BM), typically because the
	// GPU fell off the bus. The device recovers when the GPU answers again.
	ClassReboot
)

func (c Class) String() string {
	switch c {
	case ClassApp:
		return "restart-app"
	case ClassReset:
		return "reset-gpu"
	case ClassReboot:
		return "reboot"
	}
	return fmt.Sprintf("class(%d)", int(c))
}

// xidInfo is one catalog entry: its class and a short description for
// reasons and logs.
type xidInfo struct {
	class Class
	desc  string
}

// xidCatalog lists the XIDs a data-center GPU commonly reports, with the
// immediate action NVIDIA's catalog gives for Ampere and Hopper. XIDs not
// listed are treated as ClassReset: an unknown hardware fault is safest
// cleared by a reset, and a quiet period could offer a broken GPU again.
var xidCatalog = map[uint64]xidInfo{
	8:   {ClassApp, "GPU stopped processing"},
	11:  {ClassApp, "invalid or corrupted push buffer stream"},
	13:  {ClassApp, "graphics engine exception"},
	31:  {ClassApp, "GPU memory page fault"},
	32:  {ClassApp, "invalid or corrupted push buffer stream"},
	43:  {ClassApp, "GPU stopped processing"},
	45:  {ClassApp, "preemptive cleanup after a previous error"},
	48:  {ClassReset, "double-bit ECC error"},
	61:  {ClassReset, "internal micro-controller breakpoint"},
	62:  {ClassReset, "internal micro-controller halt"},
	63:  {ClassApp, "row remapping or page retirement recorded"},
	64:  {ClassReset, "row remapping or page retirement failed"},
	68:  {ClassApp, "video processor exception"},
	69:  {ClassApp, "graphics engine class error"},
	74:  {ClassReset, "NVLink error"},
	79:  {ClassReboot, "GPU has fallen off the bus"},
	92:  {ClassApp, "high single-bit ECC error rate"},
	94:  {ClassApp, "contained ECC error"},
	95:  {ClassReset, "uncontained ECC error"},
	109: {ClassApp, "context switch timeout"},
	119: {ClassReset, "GSP RPC timeout"},
	120: {ClassReset, "GSP error"},
	121: {ClassReset, "C2C link error"},
	140: {ClassReset, "unrecovered ECC error"},
	154: {ClassReset, "GPU recovery action changed"},
}

// XIDClass returns the class of an XID and a short description ("" when the
// XID is not in the catalog).
func XIDClass(xid uint64) (Class, string) {
	if info, ok := xidCatalog[xid]; ok {
		return info.class, info.desc
	}
	return ClassReset, ""
}

// Policy decides which XIDs mark a device unhealthy and how fast devices
// come back. The zero Policy is NVIDIA's default: every XID except the
// default application-error list is fatal.
type Policy struct {
	ignored               []uint64
	fatal                 []uint64
	disableDefaultIgnored bool
	// QuietPeriod is how long a device marked for a ClassApp XID must see no
	// new one before it is healthy again.
	QuietPeriod time.Duration
	// ProbeInterval is how often every GPU is probed for reachability.
	ProbeInterval time.Duration
}

// PolicyFromConfig takes the user's overrides from a config's health section;
// zero durations get config's defaults.
func PolicyFromConfig(h config.Health) Policy {
	p := Policy{
		disableDefaultIgnored: h.DisableDefaultIgnored,
		QuietPeriod:           h.RecoveryQuietPeriod.D(),
		ProbeInterval:         h.ProbeInterval.D(),
	}
	for _, x := range h.IgnoredXids {
		p.ignored = append(p.ignored, uint64(x))
	}
	for _, x := range h.FatalXids {
		p.fatal = append(p.fatal, uint64(x))
	}
	return p.withDefaults()
}

func (p Policy) withDefaults() Policy {
	if p.QuietPeriod <= 0 {
		p.QuietPeriod = config.DefaultRecoveryQuietPeriod
	}
	if p.ProbeInterval <= 0 {
		p.ProbeInterval = config.DefaultProbeInterval
	}
	return p
}

// Fatal reports whether xid marks a device unhealthy: listed as fatal, or
// neither ignored by the user nor (unless disabled) on NVIDIA's default list.
func (p Policy) Fatal(xid uint64) bool {
	if slices.Contains(p.fatal, xid) {
		return true
	}
	if slices.Contains(p.ignored, xid) {
		return false
	}
	if !p.disableDefaultIgnored {
		for _, x := range config.DefaultIgnoredXids() {
			if uint64(x) == xid {
				return false
			}
		}
	}
	return true
}
