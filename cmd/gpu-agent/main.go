// Command gpu-agent is the Kubernetes GPU node agent: kubelet device plugin,
// MIG repartitioning, sharing and DCGM-compatible metrics in one process.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

const usage = `gpu-agent: one node agent for Kubernetes GPU nodes.

Usage:
  gpu-agent run [flags]                    serve the node's GPUs to the kubelet
  gpu-agent mps-host [flags]               run the MPS control daemons the agent (run --mps-host)
                                           asks for, outside the agent's container
  gpu-agent controller [flags]             reconcile ComputeDomains (the cluster side of compute
                                           domains; a Deployment, leader-elected)
  gpu-agent status [--addr URL]            show a running agent's state
  gpu-agent top [--addr URL] [--watch D]   who holds each GPU and how much they use it
  gpu-agent config validate FILE [flags]   check a config (file, ConfigMap manifest or directory)
                                           offline: what the node would offer with it
  gpu-agent inventory [--backend B | --addr URL] [-o table|json]
                                           print the GPU inventory and topology
  gpu-agent mig plan --config FILE [--backend B | --addr URL]
                                           print the MIG repartitioning plan per GPU
  gpu-agent sim list                       list the simulated nodes
  gpu-agent mps-control-sim [-d]           the stand-in MPS control program of simulated nodes
  gpu-agent version                        print the version, commit and Go version (also --version)
  gpu-agent node-cleanup [--all | --node-name N] [--kubeconfig F]
                                           remove the Node labels gpu-agent owns (uninstall)
  gpu-agent cordon [--node-name N] GPU...  take GPUs (UUID or index) out of service: no new work
  gpu-agent uncordon [--node-name N] (GPU... | --all)
                                           put them back

The offline tools (config validate, mig plan, inventory) look at --backend
(default sim:dgx-a100, the node 'make run' simulates; nvml: this machine's
GPUs) or, with --addr, at a copy of a running agent's simulated node.

Run 'gpu-agent COMMAND --help' for a command's flags.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	os.Exit(runMain(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// runMain dispatches a command line; it returns the process exit code.
func runMain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return 2
	}
	var err error
	switch args[0] {
	case "-h", "--help", "help":
		if len(args) > 1 {
			// `gpu-agent help mig plan` is `gpu-agent mig plan --help`.
			return runMain(ctx, append(slices.Clone(args[1:]), "--help"), stdout, stderr)
		}
		fmt.Fprint(stdout, usage)
		return 0
	case "version", "--version":
		err = cmdVersion(args[1:], stdout, stderr)
	case "run":
		err = cmdRun(ctx, args[1:], stdout, stderr)
	case "mps-host":
		err = cmdMPSHost(ctx, args[1:], stdout, stderr)
	case mpsControlSimCommand:
		err = cmdMPSControlSim(ctx, args[1:], os.Stdin, stdout, stderr)
	case imexSimCommand: // hidden: the stand-in nvidia-imex of simulated nodes
		err = cmdIMEXSim(ctx, args[1:], stderr)
	case imexCtlSimCommand: // hidden: the stand-in nvidia-imex-ctl
		err = cmdIMEXCtlSim(ctx, args[1:], stdout, stderr)
	case "controller":
		err = cmdController(ctx, args[1:], stdout, stderr)
	case "status":
		err = cmdStatus(ctx, args[1:], stdout, stderr)
	case "top":
		err = cmdTop(ctx, args[1:], stdout, stderr)
	case "config":
		err = cmdConfig(ctx, args[1:], stdout, stderr)
	case "inventory":
		err = cmdInventory(ctx, args[1:], stdout, stderr)
	case "sim":
		err = cmdSim(args[1:], stdout, stderr)
	case "mig":
		err = cmdMIG(ctx, args[1:], stdout, stderr)
	case "node-cleanup":
		err = cmdNodeCleanup(ctx, args[1:], stdout, stderr)
	case "cordon", "uncordon":
		err = cmdCordon(ctx, args[0], args[1:], stdout, stderr)
	default:
		fmt.Fprintf(stderr, "gpu-agent: unknown command %q\n\n%s", args[0], usage)
		return 2
	}
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errNotReady):
		return 1
	case errors.As(err, new(usageError)):
		fmt.Fprintf(stderr, "gpu-agent %s: %v\n", args[0], err)
		return 2
	default:
		fmt.Fprintf(stderr, "gpu-agent %s: %v\n", args[0], err)
		return 1
	}
}

// usageError is a bad command line (exit code 2).
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

// newFlagSet returns a flag set that prints its usage to stderr and returns
// errors instead of exiting.
func newFlagSet(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: gpu-agent %s\n", synopsis)
		printFlags(stderr, fs)
	}
	return fs
}

// printFlags lists fs's flags as README writes them (--name; a one-letter
// flag -x), each with its usage and default; nothing for a command without
// flags. Go's flag package reads -name and --name alike.
func printFlags(w io.Writer, fs *flag.FlagSet) {
	n := 0
	fs.VisitAll(func(f *flag.Flag) {
		if n++; n == 1 {
			fmt.Fprint(w, "\nFlags:\n")
		}
		dash := "--"
		if len(f.Name) == 1 {
			dash = "-"
		}
		kind, usage := flag.UnquoteUsage(f)
		line := "  " + dash + f.Name
		if kind != "" {
			line += " " + kind
		}
		fmt.Fprintf(w, "%s\n    \t%s", line, strings.ReplaceAll(usage, "\n", "\n    \t"))
		if def := f.DefValue; def != "" && def != "false" && def != "0" {
			if kind == "string" {
				def = strconv.Quote(def)
			}
			fmt.Fprintf(w, " (default %s)", def)
		}
		fmt.Fprintln(w)
	})
}

// envDefault returns the environment variable's value, or def when unset.
func envDefault(name, def string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return def
}

// parseNoArgs parses a command line of flags only: an argument left over is
// refused rather than ignored, as a user who typed it meant something.
func parseNoArgs(fs *flag.FlagSet, args []string) error {
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError{fmt.Sprintf("unexpected arguments: %s", strings.Join(fs.Args(), " "))}
	}
	return nil
}

// parseFlags parses flags before, between and after the arguments, as every
// subcommand takes them (cordon GPU --node-name N as well as cordon
// --node-name N GPU); after "--" everything is an argument.
func parseFlags(fs *flag.FlagSet, args []string) error {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return err
			}
			return usageError{err.Error()}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			break
		}
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			positional = append(positional, rest...)
			break
		}
		positional, args = append(positional, rest[0]), rest[1:]
	}
	// Parse once more so that fs.Args() are the arguments.
	return fs.Parse(append([]string{"--"}, positional...))
}
