package main

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// backend is an initialised NVML: the real library or a simulated node.
type backend struct {
	Name             string
	Lib              nvml.Interface
	InventoryOptions gpu.Options
	// Sim is set for simulated nodes only (fault injection endpoints).
	Sim *sim.Node
	// BootID reads the node's boot id, which a reboot changes ("" when it
	// cannot be read): the kernel's, or a simulated node's own.
	BootID func() string
	// DriverRoot is where the driver's files (/proc/devices, its params)
	// and IMEX channel nodes are: "/" on a real node, a simulated node's
	// root= ("" when it has none).
	DriverRoot string
	close      func()
}

// kernelBootID is the path of Linux's boot id; a container sees the host's.
const kernelBootID = "/proc/sys/kernel/random/boot_id"

// readBootID reads a boot id file; "" when it cannot (not Linux).
func readBootID(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

func (b *backend) Close() {
	if b.close != nil {
		b.close()
	}
}

// openBackend opens "nvml" or "sim:<profile>[,option...]". nvmlLib is the
// libnvidia-ml path for the real backend ("" = the loader's search path).
// A simulated node logs to log (nil: slog's default), so that what it says
// (a failed state write, a crash-after kill) reads like the agent's own log.
func openBackend(spec, nvmlLib string, log *slog.Logger) (*backend, error) {
	switch {
	case spec == "nvml":
		var opts []nvml.LibraryOption
		if nvmlLib != "" {
			opts = append(opts, nvml.WithLibraryPath(nvmlLib))
		}
		lib := nvml.New(opts...)
		if ret := lib.Init(); ret != nvml.SUCCESS {
			return nil, fmt.Errorf("backend nvml: init NVML (library %q): %v", nvmlLibName(nvmlLib), ret.Error())
		}
		return &backend{
			Name:             spec,
			Lib:              lib,
			InventoryOptions: gpu.Options{NUMANode: gpu.SysfsNUMA("/sys"), PCIeRoot: gpu.SysfsPCIeRoot("/sys"), FabricInfo: gpu.NVMLFabricInfo},
			BootID:           func() string { return readBootID(kernelBootID) },
			DriverRoot:       "/",
			close:            func() { lib.Shutdown() },
		}, nil
	case strings.HasPrefix(spec, "sim:"):
		ss, err := parseSimSpec(spec)
		if err != nil {
			return nil, err
		}
		opts := ss.opts
		if log != nil {
			opts = append(opts, sim.WithLogger(log.With("component", "sim")))
		}
		node, err := sim.New(ss.profile, opts...)
		if err != nil {
			return nil, fmt.Errorf("backend %s: %w", spec, err)
		}
		if ret := node.Init(); ret != nvml.SUCCESS {
			node.Close()
			return nil, fmt.Errorf("backend %s: init: %v", spec, ret)
		}
		if ss.driverRoot != "" {
			if err := node.WriteDriverFiles(ss.driverRoot); err != nil {
				node.Close()
				return nil, fmt.Errorf("backend %s: %w", spec, err)
			}
		}
		return &backend{
			Name: spec, Lib: node, Sim: node, BootID: node.BootID, DriverRoot: ss.driverRoot,
			// Releases the state file at once, so a restart in the same
			// process (tests) or right after this one can open it.
			close: func() { node.Close() },
		}, nil
	}
	return nil, usageError{fmt.Sprintf("--backend %q: want nvml or sim:<profile> (see 'gpu-agent sim list')", spec)}
}

// simSpec is a parsed sim:<profile>[,option...] backend.
type simSpec struct {
	profile string
	opts    []sim.Option
	// driverRoot is where the node writes the driver's IMEX files
	// (root=); "" for none. Only a running agent writes them: the
	// offline tools look at a node, they do not set one up.
	driverRoot string
}

// simOptionsHelp lists the options parseSimSpec takes, for its errors.
const simOptionsHelp = "mig-enabled, immediate-mig-mode, state=<path>, crash-after=<n>, clique=<id>, imex-channels=<n>, root=<dir>"

// parseSimSpec reads sim:<profile>[,mig-enabled][,immediate-mig-mode][,state=<path>][,crash-after=<n>]
// [,clique=<id>][,imex-channels=<n>][,root=<dir>]. Paths cannot hold a
// comma: options are split on commas. clique= puts a fabric-attached node
// (a gb200 profile) in that NVLink domain and clique, shared by every node
// given the same id; the sim refuses it on other profiles. An option given
// twice is refused: which one was meant cannot be told.
func parseSimSpec(spec string) (simSpec, error) {
	// `sim list` prints each profile as sim:<profile>, which pasted as the
	// profile of --backend sim:PROFILE reads sim:sim:<profile>: take it.
	profile, rest, _ := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(spec, "sim:"), "sim:"), ",")
	s := simSpec{profile: profile}
	bad := func(format string, a ...any) (simSpec, error) {
		return simSpec{}, usageError{fmt.Sprintf("--backend %q: ", spec) + fmt.Sprintf(format, a...)}
	}
	if profile == "" {
		return bad("no profile after sim: (see 'gpu-agent sim list')")
	}
	seen := map[string]bool{}
	for opt := range strings.SplitSeq(rest, ",") {
		key, val, hasVal := strings.Cut(opt, "=")
		if opt != "" && seen[key] {
			return bad("sim option %s given twice", key)
		}
		seen[key] = true
		switch {
		case opt == "":
		case opt == "mig-enabled":
			s.opts = append(s.opts, sim.WithMIGEnabled())
		case opt == "immediate-mig-mode":
			s.opts = append(s.opts, sim.WithImmediateMIGModeChange())
		case key == "state" && hasVal:
			if val == "" {
				return bad("sim option state= needs a file path")
			}
			s.opts = append(s.opts, sim.WithStateFile(val))
		case key == "crash-after" && hasVal:
			n, err := strconv.Atoi(val)
			if err != nil || n < 1 {
				return bad("sim option crash-after= needs a count of GPU changes (1 or more)")
			}
			s.opts = append(s.opts, sim.WithCrashAfter(n, nil))
		case key == "clique" && hasVal:
			id, err := strconv.ParseUint(val, 10, 32)
			if err != nil {
				return bad("sim option clique=%q: want a clique id, 0 to 4294967295 (nodes with the same id share one NVLink domain)", val)
			}
			if !strings.Contains(profile, "gb200") {
				return bad("sim option clique= needs a fabric-attached profile (one with gb200 in its name), not %q", profile)
			}
			s.opts = append(s.opts, sim.WithClique(uint32(id)))
		case key == "imex-channels" && hasVal:
			n, err := strconv.Atoi(val)
			if err != nil || n < 0 || n > sim.MaxIMEXChannelCount {
				return bad("sim option imex-channels=%q: want a channel count, 0 to %d (the driver's default is %d)", val, sim.MaxIMEXChannelCount, sim.DefaultIMEXChannelCount)
			}
			s.opts = append(s.opts, sim.WithIMEXChannels(n))
		case key == "root" && hasVal:
			if val == "" {
				return bad("sim option root= needs a directory")
			}
			s.driverRoot = val
		default:
			return bad("unknown sim option %q (want %s)", opt, simOptionsHelp)
		}
	}
	return s, nil
}

func nvmlLibName(p string) string {
	if p == "" {
		return "libnvidia-ml.so.1"
	}
	return p
}
