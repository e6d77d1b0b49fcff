package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

func cmdConfig(_ context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "validate" {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fmt.Fprintln(stdout, "Usage: gpu-agent config validate FILE [--backend sim:P] [--node-name N]")
			return nil
		}
		return usageError{"want: config validate FILE [--backend sim:P] [--node-name N]"}
	}
	fs := newFlagSet("config validate", "config validate FILE [--backend sim:<profile>|nvml] [--node-name N]", stderr)
	backendSpec := fs.String("backend", envDefault("GPU_AGENT_BACKEND", "sim:dgx-a100"), "GPUs to plan against [GPU_AGENT_BACKEND]")
	host, _ := os.Hostname()
	node := fs.String("node-name", envDefault("NODE_NAME", host), "node whose config is selected [NODE_NAME]")
	nvmlLib := fs.String("nvml-lib", envDefault("GPU_AGENT_NVML_LIB", ""), "libnvidia-ml path for --backend nvml [GPU_AGENT_NVML_LIB]")
	// Accept FILE before or after the flags.
	var file string
	rest := args[1:]
	if len(rest) > 0 && len(rest[0]) > 0 && rest[0][0] != '-' {
		file, rest = rest[0], rest[1:]
	}
	if err := parseFlags(fs, rest); err != nil {
		return err
	}
	if file == "" && fs.NArg() == 1 {
		file = fs.Arg(0)
	} else if fs.NArg() > 0 || file == "" {
		return usageError{"want exactly one FILE"}
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	f, warnings, err := config.Parse(data)
	for _, w := range warnings {
		fmt.Fprintf(stderr, "warning: %s: %s\n", file, w)
	}
	if err != nil {
		return fmt.Errorf("%s: invalid:\n%w", file, err)
	}
	sel, err := f.Select(*node, nil)
	if err != nil {
		return fmt.Errorf("%s: node %s: %w", file, *node, err)
	}
	be, err := openBackend(*backendSpec, *nvmlLib)
	if err != nil {
		return err
	}
	defer be.Close()
	inv, err := gpu.New(be.Lib, be.InventoryOptions)
	if err != nil {
		return fmt.Errorf("inventory of %s: %w", be.Name, err)
	}
	planned, err := agent.Plan(agent.PlanInput{
		Inventory: inv, ConfigName: sel.Name,
		PassDeviceSpecs: sel.Config.DevicePlugin.PassDeviceSpecs,
		MIGStrategy:     sel.Config.MIG.Strategy,
		Sharing:         sel.Config.Sharing,
	})
	if err != nil {
		return fmt.Errorf("%s: does not fit %s: %w", file, be.Name, err)
	}
	cat := planned.Catalog
	if sel.MIGLayout != nil {
		fmt.Fprintf(stdout, "MIG layout on %s:\n", be.Name)
		if err := planMIG(stdout, be, inv, sel.MIGLayout, false); err != nil {
			return fmt.Errorf("%s: MIG layout does not fit %s: %w", file, be.Name, err)
		}
	}
	fmt.Fprintf(stdout, "%s: valid (%s format); node %s uses config %q (by %s)\n", file, f.Format, *node, sel.Name, sel.Reason)
	fmt.Fprintf(stdout, "On %s it would offer:\n", be.Name)
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "RESOURCE\tDEVICES\tIDS")
	for _, name := range cat.Names() {
		r := cat.Resources[name]
		ids := ""
		for i, d := range r.Devices {
			if i == 3 && len(r.Devices) > 4 {
				ids += fmt.Sprintf(", ... (%d more)", len(r.Devices)-3)
				break
			}
			if i > 0 {
				ids += ", "
			}
			ids += d.ID
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\n", name, len(r.Devices), ids)
	}
	return tw.Flush()
}

func cmdInventory(args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("inventory", "inventory [--backend nvml|sim:<profile>] [-o table|json]", stderr)
	backendSpec := fs.String("backend", envDefault("GPU_AGENT_BACKEND", "nvml"), "GPU backend [GPU_AGENT_BACKEND]")
	nvmlLib := fs.String("nvml-lib", envDefault("GPU_AGENT_NVML_LIB", ""), "libnvidia-ml path for --backend nvml [GPU_AGENT_NVML_LIB]")
	out := fs.String("o", "table", "output: table or json")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *out != "table" && *out != "json" {
		return usageError{fmt.Sprintf("-o %q: want table or json", *out)}
	}
	be, err := openBackend(*backendSpec, *nvmlLib)
	if err != nil {
		return err
	}
	defer be.Close()
	inv, err := gpu.New(be.Lib, be.InventoryOptions)
	if err != nil {
		return err
	}
	if *out == "json" {
		return gpu.WriteJSON(stdout, inv)
	}
	return gpu.WriteTable(stdout, inv)
}

func cmdSim(args []string, stdout, _ io.Writer) error {
	if len(args) != 1 || args[0] != "list" {
		if len(args) == 1 && (args[0] == "-h" || args[0] == "--help") {
			fmt.Fprintln(stdout, "Usage: gpu-agent sim list")
			return nil
		}
		return usageError{"want: sim list"}
	}
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROFILE\tDESCRIPTION")
	for _, p := range sim.Profiles() {
		fmt.Fprintf(tw, "sim:%s\t%s\n", p.Name, p.Description)
	}
	return tw.Flush()
}

func cmdMIG(args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 || args[0] != "plan" {
		if len(args) > 0 && (args[0] == "-h" || args[0] == "--help") {
			fmt.Fprintln(stdout, "Usage: gpu-agent mig plan --config FILE [--backend sim:P|nvml] [--node-name N]")
			return nil
		}
		return usageError{"want: mig plan --config FILE [--backend sim:P] [--node-name N]"}
	}
	fs := newFlagSet("mig plan", "mig plan --config FILE [--backend sim:<profile>|nvml] [--node-name N]", stderr)
	file := fs.String("config", envDefault("GPU_AGENT_CONFIG", ""), "config file [GPU_AGENT_CONFIG]")
	backendSpec := fs.String("backend", envDefault("GPU_AGENT_BACKEND", "sim:dgx-h100"), "GPUs to plan for [GPU_AGENT_BACKEND]")
	host, _ := os.Hostname()
	node := fs.String("node-name", envDefault("NODE_NAME", host), "node whose config is selected [NODE_NAME]")
	nvmlLib := fs.String("nvml-lib", envDefault("GPU_AGENT_NVML_LIB", ""), "libnvidia-ml path for --backend nvml [GPU_AGENT_NVML_LIB]")
	if err := parseFlags(fs, args[1:]); err != nil {
		return err
	}
	if *file == "" || fs.NArg() > 0 {
		return usageError{"want --config FILE and no other arguments"}
	}
	f, _, err := config.Load(*file)
	if err != nil {
		return fmt.Errorf("%s: invalid:\n%w", *file, err)
	}
	sel, err := f.Select(*node, nil)
	if err != nil {
		return fmt.Errorf("%s: node %s: %w", *file, *node, err)
	}
	if sel.MIGLayout == nil {
		fmt.Fprintf(stdout, "config %q has no MIG layout: the GPUs are left as they are\n", sel.Name)
		return nil
	}
	be, err := openBackend(*backendSpec, *nvmlLib)
	if err != nil {
		return err
	}
	defer be.Close()
	inv, err := gpu.New(be.Lib, be.InventoryOptions)
	if err != nil {
		return err
	}
	return planMIG(stdout, be, inv, sel.MIGLayout, true)
}

// planMIG prints, per GPU, what applying layout would do; steps lists the
// steps too. An impossible layout is an error naming the GPU.
func planMIG(stdout io.Writer, be *backend, inv *gpu.Inventory, layout config.MigLayout, steps bool) error {
	wants, err := mig.Desired(layout, inv)
	if err != nil {
		return err
	}
	var errs []error
	for _, g := range inv.GPUs {
		want, ok := wants[g.Index]
		if !ok {
			fmt.Fprintf(stdout, "GPU %d (%s): no layout entry applies; left as it is\n", g.Index, g.Name)
			continue
		}
		dev, ret := be.Lib.DeviceGetHandleByIndex(g.Index)
		if ret != nvml.SUCCESS {
			errs = append(errs, fmt.Errorf("gpu %d: %v", g.Index, ret))
			continue
		}
		profiles, err := mig.QueryProfiles(dev, g.MemoryBytes)
		if err != nil {
			errs = append(errs, fmt.Errorf("gpu %d: %w", g.Index, err))
			continue
		}
		plan, state, err := mig.MakePlan(g, profiles, want, nil)
		if err != nil {
			errs = append(errs, err)
		}
		fmt.Fprintf(stdout, "GPU %d (%s): want %s: %s", g.Index, g.Name, want.String(), state.Phase)
		if state.Reason != "" {
			fmt.Fprintf(stdout, " (%s)", state.Reason)
		}
		fmt.Fprintf(stdout, ", %d steps, %d instances destroyed\n", len(plan.Steps), plan.Destroys())
		for i, s := range plan.Steps {
			if steps {
				fmt.Fprintf(stdout, "  %d. %s\n", i+1, s.String())
			}
		}
	}
	return errors.Join(errs...)
}
