package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"

	"k8s.io/client-go/kubernetes"

	"github.com/gpu-agent/gpu-agent/kube"
)

// cmdCordon adds GPUs to the Node's cordon annotation (cordon) or removes
// them (uncordon): the agent on that node then offers them to no new work,
// or again. Only the agent knows the node's GPUs, so an entry naming none
// is reported by it (log, /status, a Node Event); here only the form is
// checked.
func cmdCordon(ctx context.Context, name string, args []string, stdout, stderr io.Writer) error {
	synopsis := name + " [--node-name N] [--kubeconfig F] GPU..."
	if name == "uncordon" {
		synopsis = name + " [--node-name N] [--kubeconfig F] (GPU... | --all)"
	}
	fs := newFlagSet(name, synopsis, stderr)
	host, _ := os.Hostname()
	node := fs.String("node-name", envDefault("NODE_NAME", host), "the Node whose GPUs to "+name+" [NODE_NAME]")
	kubeconfig := fs.String("kubeconfig", "", "kubeconfig (empty: as kubectl, the KUBECONFIG variable's files, then ~/.kube/config, then in-cluster config)")
	var all *bool
	if name == "uncordon" {
		all = fs.Bool("all", false, "every GPU of the node")
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	gpus := fs.Args()
	switch {
	case all != nil && *all && len(gpus) > 0:
		return usageError{"--all or GPUs, not both"}
	case (all == nil || !*all) && len(gpus) == 0:
		return usageError{"no GPU given (a GPU UUID or index)"}
	}
	if err := checkCordonGPUs(gpus); err != nil {
		return err
	}
	clients, _, err := kube.ConnectAsKubectl(*kubeconfig, "gpu-agent-"+name)
	if err != nil {
		return err
	}
	return editCordon(ctx, clients.Agent, *node, name == "cordon", gpus, stdout)
}

// checkCordonGPUs refuses what cannot name a GPU in the annotation: the
// agent would only report it as unknown.
func checkCordonGPUs(gpus []string) error {
	for _, g := range gpus {
		if n, err := strconv.Atoi(g); err == nil && n >= 0 && strconv.Itoa(n) == g {
			continue
		}
		if strings.HasPrefix(g, "MIG-") {
			return usageError{fmt.Sprintf("%s is a MIG device: cordon its GPU (UUID or index)", g)}
		}
		if !strings.HasPrefix(g, "GPU-") || strings.ContainsAny(g, ", \t\n") {
			return usageError{fmt.Sprintf("%q is neither a GPU index (0, 1, ...) nor a GPU UUID (GPU-...)", g)}
		}
	}
	return nil
}

// editCordon adds gpus to node's cordon annotation or removes them (none
// given to remove: all), and says what it lists now.
func editCordon(ctx context.Context, client kubernetes.Interface, node string, add bool, gpus []string, stdout io.Writer) error {
	var missing []string
	after, err := kube.EditCordon(ctx, client, node, func(l []string) []string {
		missing = nil
		if add {
			return kube.SplitCordon(strings.Join(append(l, gpus...), ","))
		}
		if len(gpus) == 0 {
			return nil
		}
		for _, g := range gpus {
			if !slices.Contains(l, g) {
				missing = append(missing, g)
			}
		}
		return slices.DeleteFunc(l, func(g string) bool { return slices.Contains(gpus, g) })
	})
	if err != nil {
		return err
	}
	if len(missing) > 0 {
		// Named as the annotation names it: index and UUID are not
		// interchangeable here, only the agent knows which is which.
		fmt.Fprintf(stdout, "node %s: not cordoned as written: %s\n", node, strings.Join(missing, ", "))
	}
	if len(after) == 0 {
		fmt.Fprintf(stdout, "node %s: no GPU cordoned\n", node)
		return nil
	}
	fmt.Fprintf(stdout, "node %s: cordoned GPUs: %s (see gpu-agent status for what the agent made of them)\n", node, strings.Join(after, ", "))
	return nil
}
