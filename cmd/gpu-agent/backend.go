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
	close  func()
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
			InventoryOptions: gpu.Options{NUMANode: gpu.SysfsNUMA("/sys"), PCIeRoot: gpu.SysfsPCIeRoot("/sys")},
			BootID:           func() string { return readBootID(kernelBootID) },
			close:            func() { lib.Shutdown() },
		}, nil
	case strings.HasPrefix(spec, "sim:"):
		profile, opts, err := parseSimSpec(spec)
		if err != nil {
			return nil, err
		}
		if log != nil {
			opts = append(opts, sim.WithLogger(log.With("component", "sim")))
		}
		node, err := sim.New(profile, opts...)
		if err != nil {
			return nil, fmt.Errorf("backend %s: %w", spec, err)
		}
		if ret := node.Init(); ret != nvml.SUCCESS {
			node.Close()
			return nil, fmt.Errorf("backend %s: init: %v", spec, ret)
		}
		return &backend{
			Name: spec, Lib: node, Sim: node, BootID: node.BootID,
			// Releases the state file at once, so a restart in the same
			// process (tests) or right after this one can open it.
			close: func() { node.Close() },
		}, nil
	}
	return nil, usageError{fmt.Sprintf("--backend %q: want nvml or sim:<profile> (see 'gpu-agent sim list')", spec)}
}

// parseSimSpec reads sim:<profile>[,mig-enabled][,immediate-mig-mode][,state=<path>][,crash-after=<n>].
// The state path cannot hold a comma: options are split on commas.
func parseSimSpec(spec string) (string, []sim.Option, error) {
	// `sim list` prints each profile as sim:<profile>, which pasted as the
	// profile of --backend sim:PROFILE reads sim:sim:<profile>: take it.
	profile, rest, _ := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(spec, "sim:"), "sim:"), ",")
	var opts []sim.Option
	for opt := range strings.SplitSeq(rest, ",") {
		switch key, val, hasVal := strings.Cut(opt, "="); {
		case opt == "":
		case opt == "mig-enabled":
			opts = append(opts, sim.WithMIGEnabled())
		case opt == "immediate-mig-mode":
			opts = append(opts, sim.WithImmediateMIGModeChange())
		case key == "state" && hasVal:
			if val == "" {
				return "", nil, usageError{fmt.Sprintf("--backend %q: sim option state= needs a file path", spec)}
			}
			opts = append(opts, sim.WithStateFile(val))
		case key == "crash-after" && hasVal:
			n, err := strconv.Atoi(val)
			if err != nil || n < 1 {
				return "", nil, usageError{fmt.Sprintf("--backend %q: sim option crash-after= needs a count of GPU changes (1 or more)", spec)}
			}
			opts = append(opts, sim.WithCrashAfter(n, nil))
		default:
			return "", nil, usageError{fmt.Sprintf("--backend %q: unknown sim option %q (want mig-enabled, immediate-mig-mode, state=<path>, crash-after=<n>)", spec, opt)}
		}
	}
	return profile, opts, nil
}

func nvmlLibName(p string) string {
	if p == "" {
		return "libnvidia-ml.so.1"
	}
	return p
}
