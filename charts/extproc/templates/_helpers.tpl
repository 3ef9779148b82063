{{/* Names, labels and the shared pieces of the templates. */}}

{{- define "extproc.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; the Envoy and model-server Services append to it. */}}
{{- define "extproc.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "extproc.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: extproc
{{- end }}

{{/* Selector labels of the picker pods; the Envoy pods differ by component. */}}
{{- define "extproc.selectorLabels" -}}
app.kubernetes.io/name: {{ include "extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: picker
{{- end }}

{{- define "extproc.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "extproc.envoySelectorLabels" -}}
app.kubernetes.io/name: {{ include "extproc.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: envoy
{{- end }}

{{- define "extproc.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "extproc.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "extproc.poolName" -}}
{{- default (include "extproc.fullname" .) .Values.inferencePool.name }}
{{- end }}

{{/* modelServers.matchLabels as a label selector string: "k1=v1,k2=v2", sorted. */}}
{{- define "extproc.modelSelector" -}}
{{- $pairs := list }}
{{- range $key, $value := .Values.modelServers.matchLabels }}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* The scheduler configuration file, as extproc reads it. */}}
{{- define "extproc.schedulerConfig" -}}
{{- $config := dict "scheduler" .Values.scheduler }}
{{- if kindIs "map" .Values.flowControl }}
{{- $_ := set $config "flowControl" .Values.flowControl }}
{{- end }}
{{- if .Values.modelRewrites }}
{{- $_ := set $config "modelRewrites" .Values.modelRewrites }}
{{- end }}
{{ $config | toYaml }}
{{- end }}

{{/* TLS on extproc's gRPC port: tls.mode, or the chart mode's default (gateway:
self-signed, what the Inference Extension's gateways expect of a picker; else off). */}}
{{- define "extproc.tlsMode" -}}
{{- .Values.tls.mode | default (ternary "self-signed" "off" (eq .Values.mode "gateway")) }}
{{- end }}

{{/* The Secret with extproc's tls.crt, tls.key and ca.crt. */}}
{{- define "extproc.tlsSecretName" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "extproc.fullname" .)) }}
{{- end }}

{{/* The Secret with the standalone Envoy's client tls.crt and tls.key (mtls). */}}
{{- define "extproc.envoyClientSecretName" -}}
{{- .Values.tls.envoyClientSecretName | default (printf "%s-envoy-client-tls" (include "extproc.fullname" .)) }}
{{- end }}

{{/* Values rules that the JSON schema cannot state; each fails with what to change. */}}
{{- define "extproc.validate" -}}
{{- if and .Values.networkPolicy.enabled (ne .Values.mode "standalone") (not .Values.networkPolicy.gatewayFrom) }}
{{- fail (printf "networkPolicy.gatewayFrom is empty: in %s mode, list the NetworkPolicyPeers of your gateway's Envoy pods (the only clients allowed on ext_proc port 9002), or set networkPolicy.enabled=false" .Values.mode) }}
{{- end }}
{{- $tls := include "extproc.tlsMode" . }}
{{- if and (has $tls (list "files" "mtls")) (not .Values.tls.secretName) (not .Values.tls.certManager.enabled) }}
{{- fail (printf "tls.mode %s needs the certificate: set tls.secretName (a Secret with tls.crt, tls.key and ca.crt) or tls.certManager.enabled=true" $tls) }}
{{- end }}
{{- if and .Values.tls.certManager.enabled (not .Values.tls.certManager.issuerRef.name) }}
{{- fail "tls.certManager.issuerRef.name is empty: name the cert-manager Issuer or ClusterIssuer that signs extproc's certificate" }}
{{- end }}
{{- if and .Values.inferencePool.httpRoute.enabled (eq .Values.mode "gateway") (not .Values.inferencePool.httpRoute.parentRefs) }}
{{- fail "inferencePool.httpRoute.parentRefs is empty: name the Gateway the HTTPRoute attaches to, e.g. [{name: inference-gateway}]" }}
{{- end }}
{{- include "extproc.validateKvEvents" . }}
{{- include "extproc.validateViewSnapshot" . }}
{{- end }}

{{/* The view snapshot's claim: the operator's, or the one the chart makes. */}}
{{- define "extproc.viewSnapshotClaim" -}}
{{- .Values.viewSnapshot.existingClaim | default (printf "%s-views" (include "extproc.fullname" .)) }}
{{- end }}

{{/* The chart-made claim's access modes: as set, else ReadWriteMany for several replicas
(each replica's pod mounts it, on any node), ReadWriteOnce for one. */}}
{{- define "extproc.viewSnapshotAccessModes" -}}
{{- $modes := .Values.viewSnapshot.persistence.accessModes }}
{{- if not $modes }}
{{- $modes = ternary (list "ReadWriteMany") (list "ReadWriteOnce") (gt (int .Values.replicas) 1) }}
{{- end }}
{{- toJson $modes }}
{{- end }}

{{- define "extproc.validateViewSnapshot" -}}
{{- $vs := .Values.viewSnapshot }}
{{- if and $vs.enabled (not $vs.existingClaim) (gt (int .Values.replicas) 1) }}
{{- if not (has "ReadWriteMany" (include "extproc.viewSnapshotAccessModes" . | fromJsonArray)) }}
{{- fail (printf "viewSnapshot.persistence.accessModes %v with %d replicas: the replicas' pods share the volume, so it must be ReadWriteMany (or leave accessModes empty)" $vs.persistence.accessModes (int .Values.replicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when scheduler.plugins.Score enables precise-prefix-cache, else "". */}}
{{- define "extproc.preciseScored" -}}
{{- range (dig "Score" "enabled" list .Values.scheduler.plugins) }}
{{- if eq .name "precise-prefix-cache" }}true{{ end }}
{{- end }}
{{- end }}

{{/* kvEvents and the precise-prefix-cache plugin go together: the plugin needs the
events and the tokenizers, the events feed nothing else. */}}
{{- define "extproc.validateKvEvents" -}}
{{- $kv := .Values.kvEvents }}
{{- $precise := include "extproc.preciseScored" . }}
{{- if and $precise (not $kv.enabled) }}
{{- fail "scheduler scores with precise-prefix-cache, which reads the model servers' KV events and the tokenizers: set kvEvents.enabled=true and kvEvents.tokenizers.volume" }}
{{- end }}
{{- if $kv.enabled }}
{{- if not $precise }}
{{- fail "kvEvents.enabled: the events feed the precise-prefix-cache plugin, which scheduler.plugins.Score.enabled does not list (values-precise.yaml has extproc's precise configuration)" }}
{{- end }}
{{- if not $kv.tokenizers.volume }}
{{- fail "kvEvents.tokenizers.volume is empty: name the volume holding the tokenizers, e.g. {persistentVolumeClaim: {claimName: tokenizers}}" }}
{{- end }}
{{- $models := dict }}
{{- range .Values.scheduler.pluginConfig }}
{{- if eq .name "precise-prefix-cache" }}
{{- $models = dig "models" dict (.args | default dict) }}
{{- end }}
{{- end }}
{{- if not $models }}
{{- fail (printf "precise-prefix-cache has no models: set its args.models in scheduler.pluginConfig, each served model's tokenizer directory under kvEvents.tokenizers.mountPath (%s)" $kv.tokenizers.mountPath) }}
{{- end }}
{{- $mount := trimSuffix "/" $kv.tokenizers.mountPath }}
{{- range $model, $dir := $models }}
{{- if not (or (eq (toString $dir) $mount) (hasPrefix (printf "%s/" $mount) (toString $dir))) }}
{{- fail (printf "precise-prefix-cache's models.%s is %s, outside kvEvents.tokenizers.mountPath (%s) where the tokenizers are mounted" $model $dir $mount) }}
{{- end }}
{{- end }}
{{- if and (eq $kv.topology "bind") (gt (int .Values.replicas) 1) }}
{{- fail "kvEvents.topology bind takes one replica: each model server's publisher connects to a single replica through the Service; with replicas > 1 use topology connect" }}
{{- end }}
{{- if and (eq $kv.topology "bind") (has (int $kv.port) (list 9002 9003 9090)) }}
{{- fail (printf "kvEvents.port %d is one of extproc's own ports (9002, 9003, 9090): pick another port to bind" (int $kv.port)) }}
{{- end }}
{{- if and (eq $kv.topology "connect") (eq (int $kv.port) (int ($kv.replayPort | default 0))) }}
{{- fail "kvEvents.replayPort equals kvEvents.port: a pod's publisher and replay endpoint need a port each" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The Redis the replicas share their view through: redis.url, else the chart's own
Redis when redis.deploy, else "" (no sharing). */}}
{{- define "extproc.redisUrl" -}}
{{- if .Values.redis.url -}}
{{ .Values.redis.url }}
{{- else if .Values.redis.deploy -}}
redis://{{ include "extproc.fullname" . }}-redis:6379/0
{{- end -}}
{{- end }}
